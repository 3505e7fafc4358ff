"""Many outboxes, one fleet (issue 36): the source registry, fairness between outboxes, and the
fleet membership that shares them between processes."""
