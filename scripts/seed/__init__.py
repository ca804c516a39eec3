"""The seed experiment's parts (``scripts/seed_experiment.py`` is the command; docs/benchmarks.md §9).

* ``common``: the model directory, the daemon and engine processes, counters, statistics;
* ``engine``: the engine role (this package's code inside the vLLM process);
* ``revisit``: the original experiment (documents revisited, engine alone vs kvtier);
* ``chats``: multi-turn conversations (tokens by source per turn);
* ``fleet``: two engines sharing one daemon (cross-replica hits);
* ``mix``: concurrent clients, revisits and new documents (sync vs async loads vs alone);
* ``shared``: tenants sharing a system prompt, flat salting vs a published prefix (issue 43).
"""
