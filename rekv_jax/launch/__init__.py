"""Processes started from Python: a job function run by each member of a group (a pair is the
group of decode-0 and prefill-0), or by one fresh process, each spawned in its own environment,
supervised, and answering in Python objects.

- `environments`: what each side of a pair (`pair_environments`) or each member of a group
  (`group_environments`) on one machine gets (its GPUs or memory share, or its cores), before
  JAX starts in it;
- `child`: what runs inside a spawned process (its entry, and the `Member` a job is handed);
- `processes`: one spawned process watched from its parent, and how it ended, in one line;
- `group`: the launcher: N member processes (`Group`), which the parent talks to while they run
  and outlives any one of them; a group run as one job that ends together (`Job`, `run_pair`);
  one fresh process (`run_child`);
- `nodes`: the same group across nodes (`NodeGroup`), each member started on its own node
  (`run_member`) and joined to the parent over one connection authenticated by the job's key;
- `runtime`: what both sides must share for their bits to agree.
"""
