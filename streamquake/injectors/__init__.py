"""Fault injectors: one file per fault family, each implementing ``base.Injector``."""

from streamquake.injectors.base import Injector, RunContext, injector_class, register

__all__ = ["Injector", "RunContext", "injector_class", "register"]
