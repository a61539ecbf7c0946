"""A run's memory plan: its device memory item by item (`plan`, from the arithmetic of `fastgrpo.memory` and the
sizes the engine, the controller and the drafters' plugins give) and whether it fits the device (`fitting`)."""
