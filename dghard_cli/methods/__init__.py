"""Per-tensor methods: small functions the streaming pipeline runs on each eligible tensor."""
