"""The arithmetic of device memory: a model's shapes (`shapes`), what training saves for its backward
(`activations`) and the items a plan is made of (`items`). `fastgrpo.memory_plan` makes a run's plan from them."""
