"""The serving engine (SPEC sections 3, 5, 6): page pool memory, expert store, mover, scheduler, loop."""
