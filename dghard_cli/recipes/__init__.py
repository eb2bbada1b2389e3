"""Merge recipes: dghard's YAML recipe (:mod:`dghard_cli.recipes.recipe`, ``dghard merge
--config``) and mergekit's, translated into it (:mod:`dghard_cli.recipes.mergekit`, reading the
configuration in :mod:`dghard_cli.recipes.mergekit_config` and mapping the methods in
:mod:`dghard_cli.recipes.mergekit_mapping`)."""
