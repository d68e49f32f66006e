"""Processes started from Python: a job function run by both sides of a pair, by each member of
a group, or by one fresh process, each spawned in its own environment, supervised, and answering
in Python objects.

- `environments`: what each side of a pair (each member of a group) on one machine gets (its
  GPUs or memory share, or its cores), before JAX starts in it;
- `child`: what runs inside a spawned process (its entry, and the `Side` or `Member` a job is
  handed);
- `processes`: one spawned process watched from its parent, and how it ended, in one line;
- `pair`: the launcher (`Pair`, `run_pair`, `run_child`);
- `group`: the launcher of N member processes (`Group`), several per side, which the parent
  talks to while they run and outlives any one of them;
- `nodes`: the same group across nodes (`NodeGroup`), each member started on its own node
  (`run_member`) and joined to the parent over one connection authenticated by the job's key;
- `runtime`: what both sides must share for their bits to agree.
"""
