"""The tiers' names, fastest first: the one place they are spelled. `state.Location` is made of
them, and the config keys that name a tier accept them (torch-free: the config reads them)."""

TIER_NAMES = ("device", "host", "nvme")
