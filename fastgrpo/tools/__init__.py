"""Tools a completion may call during its rollout: the functions (`functions`), how a chat template shows and
parses their calls (`format`), where they run (`runner`) and a generation call's turns (`turns`)."""
