"""The model runner: the one owner of device memory (page pool, KV store, expert store, CUDA graphs)."""
