"""A run's device memory, estimated from its options and the model's config alone: the model's shapes (`shapes`),
what training saves (`activations`), the plan's items (`items`), the plan (`plan`) and whether it fits (`fitting`)."""
