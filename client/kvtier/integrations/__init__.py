"""Engine integrations. Each one is imported on its own (``kvtier.integrations.vllm``) and
imports its engine only when its connector class is first used."""
