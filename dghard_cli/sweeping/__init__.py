"""``dghard sweep``: candidate families, the search within a budget, the user's evaluation, the frontier plot."""
