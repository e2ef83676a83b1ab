/* Q4_1 GEMV at one activation row on one core, two ways (a prototype for issue 21's CPU target, not the engine's
 * code; benchmarks/cpu_q4_gemv_kernels.py builds and runs it):
 *   option_a  the engine's inner loop (kernels/cpu/gguf_linear.c, rows_avx512_impl at one row): fp32 activations
 *             times the file's blocks, each block's nibbles widened to floats;
 *   option_r  int8 activations (per-32-block scale, llama.cpp's Q8_1 way) times blocks repacked at load (the 16
 *             nibble bytes of two blocks contiguous, d and m as float arrays): two blocks per 512-bit VNNI
 *             product, no per-block fp16 conversions or unpacking beyond one and / shift; x is stored in the
 *             nibbles' order at quantization, so no shuffles.
 * Prints one JSON line: microseconds a call (best of 5 x 200), weights/s, option_r's error against an exact
 * (double) product of the dequantized weights with the same quantized x, and option_a's distance to that.
 * Needs AVX-512 F/BW/VL + VNNI. Build: cc -O2 -o gemv cpu_q4_gemv_kernels.c -lm; run: ./gemv N K. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
T static float h2f(uint16_t h){return _cvtsh_ss(h);}

T static void option_a(const uint8_t*w,int N,int NB,const float*x,const float*xs,float*y){
  for(int n=0;n<N;n++){const uint8_t*wr=w+(size_t)n*NB*20; __m512 a0=_mm512_setzero_ps(),a1=_mm512_setzero_ps(); float macc=0;
    const __m128i lo=_mm_set1_epi8(15);
    for(int b=0;b<NB;b++){const uint8_t*blk=wr+20*b; uint32_t dm; memcpy(&dm,blk,4); __m128 dmf=_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
      float d=_mm_cvtss_f32(dmf), m=_mm_cvtss_f32(_mm_shuffle_ps(dmf,dmf,1)); __m128i v=_mm_loadu_si128((const __m128i*)(blk+4));
      __m512 q0=_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v,lo))), q1=_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v,4),lo)));
      __m512 t=_mm512_mul_ps(_mm512_loadu_ps(x+32*b),q0); t=_mm512_fmadd_ps(_mm512_loadu_ps(x+32*b+16),q1,t);
      if(b&1) a1=_mm512_fmadd_ps(t,_mm512_set1_ps(d),a1); else a0=_mm512_fmadd_ps(t,_mm512_set1_ps(d),a0); macc+=m*xs[b];}
    y[n]=_mm512_reduce_add_ps(_mm512_add_ps(a0,a1))+macc;}
}

/* Repacked at load, per row: qs of blocks (2p, 2p+1) as 32 contiguous bytes; d and m as float arrays. */
typedef struct { uint8_t *qs; float *d; float *m; } Repacked;
static Repacked repack(const uint8_t*w,int N,int NB){Repacked r; r.qs=aligned_alloc(64,(size_t)N*NB*16); r.d=aligned_alloc(64,(size_t)N*NB*4); r.m=aligned_alloc(64,(size_t)N*NB*4);
  for(size_t i=0;i<(size_t)N*NB;i++){uint16_t d,m; memcpy(&d,w+20*i,2); memcpy(&m,w+20*i+2,2); r.d[i]=h2f(d); r.m[i]=h2f(m); memcpy(r.qs+16*i,w+20*i+4,16);} return r;}

/* x quantized per 32-block (max|x|/127), in the nibble order of a block pair: [x_b lo16 | x_b+1 lo16 | x_b hi16 | x_b+1 hi16]. */
T static void quantize_x(const float*x,int NB,int8_t*xq,float*xd,float*xsum){
  for(int b=0;b<NB;b++){float amax=0; for(int j=0;j<32;j++){float a=fabsf(x[32*b+j]); if(a>amax) amax=a;}
    float dx=amax/127.f, inv=dx?1.f/dx:0.f; int s=0; int p=b/2, h=b%2; int8_t*o=xq+64*p;
    for(int j=0;j<32;j++){int q=(int)lrintf(x[32*b+j]*inv); s+=q; int pos=(j<16? 0:32)+16*h+(j&15); o[pos]=(int8_t)q;}
    xd[b]=dx; xsum[b]=dx*s;}
}

T static void option_r(const Repacked*r,int N,int NB,const int8_t*xq,const float*xd,const float*xsum,float*y){
  const __m256i lo=_mm256_set1_epi8(15);
  /* lanes 0-3 and 8-11 belong to block 2p, lanes 4-7 and 12-15 to block 2p+1 */
  const __m512i sel=_mm512_set_epi32(1,1,1,1,0,0,0,0,1,1,1,1,0,0,0,0);
  for(int n=0;n<N;n++){const uint8_t*qs=r->qs+(size_t)n*NB*16; const float*dr=r->d+(size_t)n*NB, *mr=r->m+(size_t)n*NB;
    __m512 acc0=_mm512_setzero_ps(), acc1=_mm512_setzero_ps(); __m512 macc=_mm512_setzero_ps();
    int b=0;
    for(;b+2<=NB;b+=2){
      {int h=(b>>1)&1; int bb=b;
        __m256i v=_mm256_loadu_si256((const __m256i*)(qs+16*bb));
        __m512i wq=_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v,lo)),_mm256_and_si256(_mm256_srli_epi16(v,4),lo),1);
        __m512i p=_mm512_dpbusd_epi32(_mm512_setzero_si512(),wq,_mm512_loadu_si512(xq+32*bb));
        __m512 sc=_mm512_permutexvar_ps(sel,_mm512_castps128_ps512(_mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double*)(dr+bb))),_mm_castpd_ps(_mm_load_sd((const double*)(xd+bb))))));
        if(h) acc1=_mm512_fmadd_ps(_mm512_cvtepi32_ps(p),sc,acc1); else acc0=_mm512_fmadd_ps(_mm512_cvtepi32_ps(p),sc,acc0);}
    }
    float tail=0; for(;b<NB;b++){ /* scalar tail */ const uint8_t*q=qs+16*b; int s=0; int p=b/2,h=b%2; const int8_t*o=xq+64*p;
      for(int j=0;j<16;j++){s+=(q[j]&15)*o[16*h+j]; s+=(q[j]>>4)*o[32+16*h+j];} tail+=dr[b]*xd[b]*s;}
    int c=0; for(;c+16<=NB;c+=16) macc=_mm512_fmadd_ps(_mm512_loadu_ps(mr+c),_mm512_loadu_ps(xsum+c),macc);
    float mt=0; for(;c<NB;c++) mt+=mr[c]*xsum[c];
    y[n]=_mm512_reduce_add_ps(_mm512_add_ps(acc0,acc1))+_mm512_reduce_add_ps(macc)+mt+tail;}
}

T int main(int argc,char**argv){int N=argc>1?atoi(argv[1]):3072, K=argc>2?atoi(argv[2]):576, NB=K/32;
  uint8_t*w=malloc((size_t)N*NB*20); srand(1); for(size_t i=0;i<(size_t)N*NB*20;i++) w[i]=rand();
  for(size_t i=0;i<(size_t)N*NB;i++){uint16_t d=0x2400+(rand()&0x3ff), m=0xa400+(rand()&0x3ff); memcpy(w+20*i,&d,2); memcpy(w+20*i+2,&m,2);}
  float*x=malloc(K*4),*xs=malloc(NB*4),*xd=malloc(NB*4),*xsum=malloc(NB*4); int8_t*xq=aligned_alloc(64,((NB+1)/2)*64+64);
  for(int k=0;k<K;k++) x[k]=(float)(rand()/(double)RAND_MAX-0.5);
  for(int b=0;b<NB;b++){xs[b]=0;for(int j=0;j<32;j++) xs[b]+=x[32*b+j];}
  Repacked r=repack(w,N,NB); float*ya=malloc(N*4),*yr=malloc(N*4),*yref=malloc(N*4);
  /* reference: dequantized W times the quantized x (what option r computes), in double */
  quantize_x(x,NB,xq,xd,xsum);
  double rel=0, num=0, den=0;
  option_a(w,N,NB,x,xs,ya); option_r(&r,N,NB,xq,xd,xsum,yr);
  for(int n=0;n<N;n++){double acc=0; for(int b=0;b<NB;b++){const uint8_t*blk=w+((size_t)n*NB+b)*20; uint16_t dd,mm; memcpy(&dd,blk,2); memcpy(&mm,blk+2,2);
      int p=b/2,h=b%2; const int8_t*o=xq+64*p; for(int j=0;j<16;j++){ acc+=(h2f(dd)*(blk[4+j]&15)+h2f(mm))*xd[b]*o[16*h+j]; acc+=(h2f(dd)*(blk[4+j]>>4)+h2f(mm))*xd[b]*o[32+16*h+j]; }}
    yref[n]=acc; num+=(yr[n]-acc)*(yr[n]-acc); den+=acc*acc;}
  rel=sqrt(num/den);
  double qa=0,qd=0; for(int n=0;n<N;n++){qa+=(ya[n]-yref[n])*(ya[n]-yref[n]); qd+=ya[n]*ya[n];}
  int reps=200; double best_a=1e9,best_r=1e9,best_q=1e9;
  for(int t=0;t<5;t++){double s=now(); for(int i=0;i<reps;i++) option_a(w,N,NB,x,xs,ya); double ta=(now()-s)/reps; if(ta<best_a) best_a=ta;
    s=now(); for(int i=0;i<reps;i++){quantize_x(x,NB,xq,xd,xsum);} double tq=(now()-s)/reps; if(tq<best_q) best_q=tq;
    s=now(); for(int i=0;i<reps;i++) option_r(&r,N,NB,xq,xd,xsum,yr); double tr=(now()-s)/reps; if(tr<best_r) best_r=tr;}
  printf("{\"N\": %d, \"K\": %d, \"option_a_us\": %.2f, \"repacked_int8_us\": %.2f, \"quantize_x_us\": %.2f, \"speedup\": %.2f, "
         "\"Gweights_per_s_a\": %.2f, \"Gweights_per_s_r\": %.2f, \"rel_err_r_vs_exact_of_quantized_x\": %.2e, \"rel_diff_a_vs_quantized_x\": %.2e}\n",
         N,K,best_a*1e6,best_r*1e6,best_q*1e6,best_a/(best_r+best_q),N*(double)K/best_a/1e9,N*(double)K/best_r/1e9,rel,sqrt(qa/qd));
}
