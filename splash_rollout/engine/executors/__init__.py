"""Per-layout attention executors (single rank now; TP/DP/DOP/CP later)."""
