"""Any-Precision (AP) artifacts on the runtime side: reading planes, LUTs and the manifest."""
