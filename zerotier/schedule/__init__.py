from .prefetch import PrefetchScheduler

__all__ = ["PrefetchScheduler"]
