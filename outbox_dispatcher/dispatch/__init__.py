"""The loop: the supervisor, the claim loops, and one batch's run (claim -> publish -> settle)."""
