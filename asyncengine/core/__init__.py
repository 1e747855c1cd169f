"""The engine core: EngineCore.step() and the busy loop that drives it."""
