"""Offline helpers run as `python -m deepserve.tools.<name>` (e.g. make_tiny_checkpoint); not used at serving time."""
