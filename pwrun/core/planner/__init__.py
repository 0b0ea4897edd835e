"""The planner (SPEC section 5, Algorithm 1): control plane on numpy arrays, no torch."""
