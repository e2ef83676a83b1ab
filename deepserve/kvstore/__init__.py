"""The cross-instance KV cache store: a block's KV, content-addressed, in host memory, on disk or in Redis.

keys.py (what names an entry), codec.py (entry bytes with a checksum), memory_tier.py / disk_tier.py /
redis_tier.py (one storage tier each, size-bounded), store.py (the tiers in order, write-behind saves, metrics).
The engine's side (when blocks are saved and loaded) is engine/kv_store_connector.py.
"""
