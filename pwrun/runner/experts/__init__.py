"""AP expert weights in the page pool: host mirror and copies, kernel tables, the MoE forward."""
