"""One page pool per device shared by KV blocks and weight bit-planes (control plane, no torch)."""
