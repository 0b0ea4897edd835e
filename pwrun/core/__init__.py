"""The engine core (control plane): requests, scheduler, page pool, weight page table, KV blocks, planner.

Imports no torch and no pandas: everything here works on ints and numpy arrays and is tested without a
model (``EngineCore.step()`` -> ``StepDecision``; the model runner executes it).
"""
