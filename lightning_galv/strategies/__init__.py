from .galvatron import GalvatronStrategy

__all__ = ["GalvatronStrategy"]
