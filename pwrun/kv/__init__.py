"""Paged KV cache: block allocator (control plane, no torch) and block storage (torch)."""
