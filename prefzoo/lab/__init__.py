"""The lab: the algorithm plugins, unchanged, on problems whose answers are known in closed form.

* :mod:`prefzoo.lab.tabular` — the tabular bed: a policy that is a table of logits over single-token
  responses, its scorer, prompt and preference-pair sources, and a driver (``train``) that takes the
  Trainer's own optimisation step (:func:`prefzoo.training.step.optimisation_step`).
* :mod:`prefzoo.lab.oracles` — the theory: the fixed point each conformance case is measured against.
* :mod:`prefzoo.lab.runner` — the one runner of the lab's drivers: a plugin trained from pi_ref on stacked
  replicas of a bandit, and best-of-n sampled on it.
* :mod:`prefzoo.lab.conformance` — ``python -m prefzoo.lab.conformance``: the conformance cases and their table
  (``docs/conformance.md``).
* :mod:`prefzoo.lab.toy` — ``python -m prefzoo.lab.toy``: the toy bandit (reward hacking, the inverted U;
  ``docs/toy_bandit.md``).

The lab sits on top of the house: it imports plugins, the objective and ``training.step``; nothing imports it.
"""
