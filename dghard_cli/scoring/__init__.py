"""``dghard score``: partition-conditioned scoring of evaluation results."""
