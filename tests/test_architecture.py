"""Guards that keep the house standing (DESIGN.md, "Which way the imports run"; the plugin-contract issue; the online
family issue).

* every room imports only the rooms below it (the table :data:`ALLOWED`), lazy imports inside functions included;
* four sideways imports of the middle of the house stay gone (:data:`SIDEWAYS`): the config does not reach the data,
  reward and metric registries (the pre-flight checks those names), the rollout does not import the models, the data
  does not import the rewards, the rewards do not import the evaluation;
* no plugin subclasses another plugin: what a family shares is its body (``algos/online.py``,
  ``algos/pairwise.py``), which is not a plugin;
* ``prefzoo/__init__.py`` imports no room at module level: ``import prefzoo`` stays light, and the Python API
  (``prefzoo.train``, ``prefzoo.load_policy``, ``prefzoo.RunResult``) comes from ``prefzoo/api.py``, the top room,
  through the package's module ``__getattr__`` on first use (the ecosystem-fit issue: this rule changed on purpose
  from "``__init__`` imports nothing of prefzoo" to "only ``api``, and only lazily");
* nothing but the loop, the lab and the CLI imports ``prefzoo.algos``;
* no ``hasattr``/``getattr`` on a plugin anywhere: a plugin's needs and capabilities are declared;
* every yaml in ``conf/`` restates no dataclass default (or it equals it and says nothing).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import prefzoo
from prefzoo.algos import BUILTIN

ROOT = Path(prefzoo.__file__).parent

#: room -> the rooms it may import (besides itself). ``errors``, ``text`` and ``runtime`` (the numerics environment, the
#: libraries' version differences) are leaves everyone may import.
BASE = {"errors", "text", "runtime"}
MIDDLE = {"types", "objective", "config", "validation", "models", "data", "rollout", "rewards", "evaluation",
          "environments"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "text": set(),
    "runtime": set(),
    "objective": BASE,
    "types": BASE | {"objective"},
    "algos": BASE | {"objective", "types"},
    "config": BASE | {"objective", "types"},
    # multi-turn environments and tools (issue 28): the shared vocabulary only; the rollout and the loop use them
    # (the built-in ones read answers as the verifier does; the demonstrations are written from the task's problems)
    "environments": BASE | {"objective", "types", "rewards", "data"},
    "validation": BASE | MIDDLE | {"tinker"},  # config's checks of names and paths (reward functions, adapters, metrics)
    # models, data, rollout, rewards, evaluation: the shared vocabulary and each other, never algos or the loop
    **{room: BASE | MIDDLE for room in ("models", "data", "rollout", "rewards", "evaluation")},
    "training": BASE | MIDDLE | {"algos", "tinker"},  # backend=tinker: the remote policy and optimizer
    "lab": BASE | MIDDLE | {"algos", "training"},
    "report": BASE | MIDDLE | {"training", "lab"},
    "cli": BASE | MIDDLE | {"algos", "training", "lab", "report"},
    # prefzoo serve (issue 31): a vLLM server on the model a run resolves (models) with the names the trainer checks
    # (rollout); beside the loop, not under it
    "serve": BASE | MIDDLE | {"tinker"},
    # the Tinker training API (issue 50): direction A, prefzoo's own Tinker server on the models, the rollout and the
    # objective's losses; beside the loop, never the plugins or the loop itself
    "tinker": BASE | MIDDLE,
    "commands": BASE | MIDDLE | {"algos", "training", "lab", "report", "cli", "serve", "tinker"},  # the prefzoo console script
    "diagnose": BASE | {"report"},  # python -m prefzoo.diagnose: the beta doctor of prefzoo.report.diagnose
    "__main__": BASE | MIDDLE | {"algos", "training", "lab", "report", "cli", "commands", "serve", "tinker"},
    # the Python API (prefzoo.train / load_policy): the command line's path, without its printing and exiting
    "api": BASE | MIDDLE | {"algos", "training", "cli", "commands"},
    "__init__": {"api"},  # lazily only (module __getattr__): see test_the_package_imports_the_api_only_lazily
}


def room_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def prefzoo_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported room) of every prefzoo import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = ".".join(("prefzoo",) + path.relative_to(ROOT).parent.parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            if names == ["prefzoo"]:  # from prefzoo import api, config: each imported name is a room
                names = [f"prefzoo.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "prefzoo" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        room = room_of(path)
        assert room in ALLOWED, f"{path.relative_to(root)}: a room the import table does not know ({room!r}); " \
                                "add it to tests/test_architecture.py's ALLOWED on purpose"
        for line, target in prefzoo_imports(path):
            if target != room and target not in ALLOWED[room]:
                found.append(f"{path.relative_to(root)}:{line} ({room}) imports prefzoo.{target}")
    return found


def test_every_room_imports_only_the_rooms_below_it():
    assert violations() == []


#: (room or module, a room it must not import): the four sideways imports the online-family issue removed
SIDEWAYS = [("config", "validation"), ("config", "data"), ("config", "rewards"), ("config", "evaluation"),
            ("rollout", "models"), ("data", "rewards"), ("rewards", "evaluation")]


def test_the_sideways_imports_of_the_middle_stay_gone():
    """config.py imports no registry (not even through validation.py: the pre-flight calls those checks); rollout/
    imports no model module, data/ no reward module, rewards/ no evaluation module (lazy imports included). The
    shared constants and helpers they used live where both sides see them (``prefzoo.types.PROMPT_MESSAGES``,
    ``prefzoo.text``; the merged copy is handed to the engine as a factory)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        room = room_of(path)
        for line, target in prefzoo_imports(path):
            if (room, target) in SIDEWAYS:
                found.append(f"{path.relative_to(ROOT)}:{line} ({room}) imports prefzoo.{target}")
    assert found == []


def test_no_plugin_subclasses_another_plugin():
    """Compose, don't inherit (DESIGN.md): no built-in plugin has another plugin among its base classes, and the
    family bodies a plugin derives from are not plugins (never registered, no algo= name of their own)."""
    from prefzoo.algos import REGISTRY
    from prefzoo.algos.online import OnlinePolicyGradient
    from prefzoo.algos.pairwise import DirectPreference

    plugins = {cls for name, cls in REGISTRY.items() if name in BUILTIN}
    assert len(plugins) == len(BUILTIN)
    assert subclassed_plugins(plugins) == []
    for body in (OnlinePolicyGradient, DirectPreference):
        assert body not in REGISTRY.values() and "name" not in body.__dict__


def subclassed_plugins(plugins: set[type]) -> list[str]:
    """``"A subclasses B"`` for every plugin A of ``plugins`` with another plugin B among its base classes."""
    return sorted(f"{cls.__name__} subclasses {base.__name__}" for cls in plugins for base in cls.__mro__[1:]
                  if base in plugins)


def test_the_plugin_inheritance_guard_fails_on_a_subclassed_plugin():
    """The guard itself: GSPO as it was (a subclass of GRPO) is reported; two members of one family are not."""
    from prefzoo.algos.grpo import GRPO
    from prefzoo.algos.rloo import RLOO

    class OldGSPO(GRPO):
        name = "old_gspo"

    assert subclassed_plugins({GRPO, RLOO, OldGSPO}) == ["OldGSPO subclasses GRPO"]


def test_the_package_imports_the_api_only_lazily():
    """``prefzoo/__init__.py``: no prefzoo import at module level (only inside functions: its ``__getattr__``), and
    the lazy one is ``prefzoo.api``. (tests/test_api.py checks in a fresh interpreter that ``import prefzoo`` loads no
    torch, transformers, peft, Hydra.)"""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in top if "prefzoo" in ast.unparse(n)] == []
    assert {room for _, room in prefzoo_imports(ROOT / "__init__.py")} == {"api"}


def test_the_import_direction_test_fails_on_a_wrong_import(tmp_path):
    """The guard itself: a models/ module that imports the plugins is reported."""
    pkg = tmp_path / "prefzoo"
    (pkg / "models").mkdir(parents=True)
    (pkg / "models" / "bad.py").write_text("def f():\n    from prefzoo.algos import REGISTRY\n")
    (pkg / "objective").mkdir()
    (pkg / "objective" / "x.py").write_text("from ..training import loop\n")
    (pkg / "data").mkdir()
    (pkg / "data" / "y.py").write_text("from prefzoo import algos\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        found = violations(pkg)
    finally:
        ROOT = saved
    assert any("models/bad.py:2 (models) imports prefzoo.algos" in f for f in found), found
    assert any("objective/x.py:1 (objective) imports prefzoo.training" in f for f in found), found
    assert any("data/y.py:1 (data) imports prefzoo.algos" in f for f in found), found


PLUGIN_NAMES = ("algo", "plugin", "self.algo", "algorithm")


def test_no_module_probes_a_plugin_with_hasattr_or_getattr():
    """The loop provides what a plugin declares; it never asks ``hasattr(algo, ...)`` (the plugin-contract issue)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if room_of(path) == "algos":  # a plugin may read its own config's fields
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
                first = ast.unparse(node.args[0]) if node.args else ""
                if any(first == n or first.startswith(n + ".") or first.endswith("algo") for n in PLUGIN_NAMES):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _defaults(schema) -> dict:
    out = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _restated(node: dict, schema, where: str) -> list[str]:
    found = []
    defaults = _defaults(schema)
    types = {f.name: f.type for f in dataclasses.fields(schema)}
    for key, value in node.items():
        if key == "defaults" or key not in defaults:
            continue
        default = defaults[key]
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            found += _restated(value, type(default), f"{where}.{key}")
        elif value == default and key != "name":
            found.append(f"{where}.{key}: {value!r} equals the dataclass default ({types[key]})")
    return found


def test_no_yaml_in_conf_restates_a_dataclass_default():
    """DESIGN.md: defaults live in one place (the typed config); yaml files hold only what differs."""
    import yaml

    from prefzoo.algos import REGISTRY
    from prefzoo.config import GROUP_SCHEMAS, Config

    conf = ROOT.parent / "conf"
    found = []
    for path in sorted(conf.rglob("*.yaml")):
        rel = path.relative_to(conf)
        data = yaml.safe_load(path.read_text()) or {}
        group = rel.parts[0] if len(rel.parts) > 1 else None
        if group == "algo" and path.stem in REGISTRY:
            found += _restated(data, REGISTRY[path.stem].config_class, f"{rel}")
        elif group in GROUP_SCHEMAS:
            found += _restated(data, GROUP_SCHEMAS[group], f"{rel}")
        elif group is None:
            found += _restated(data, Config, f"{rel}")
    assert found == []


@pytest.mark.parametrize("name", BUILTIN)
def test_every_builtin_plugin_declares_its_needs(name):
    from prefzoo.algos import REGISTRY
    from prefzoo.algos.base import Declaration
    from prefzoo.config import Config, resolve_objective

    cls = REGISTRY[name]
    from tests.algos.hydra_runs import REQUIRED_SETTINGS

    cfg = Config(algo=cls.config_class(**REQUIRED_SETTINGS.get(name, {})))
    algo = cls(cfg.algo, resolve_objective(cfg))
    assert isinstance(algo.declaration, Declaration)
    for capability in algo.declaration.capabilities:  # a declared capability is implemented, not the base's stub
        method = {"implicit_rewards": "implicit_rewards", "precomputed_reference": "reference_logps",
                  "saves_artifacts": "save_artifacts", "step_statistics": "step_statistics",
                  "adaptive_beta": "after_step",  # (after_step updates the KL controller)
                  "turn_rewards": "make_experience",  # (its returns take the step rewards per turn)
                  "sampler_correction": "make_experience",  # (it weights its loss by the correction)
                  "f_divergence": "loss"}[capability]  # (its loss's link is the objective's f-divergence)
        assert getattr(type(algo), method) is not getattr(type(algo).__mro__[-2], method)


#: the names a plugin or a policy object goes by where it is used (``self.algo``, ``trainer.policy``, ``policy``)
PLUGIN_OR_POLICY = {"algo", "plugin", "policy"}


def attribute_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, ``obj.attr``) of every assignment to an attribute of an object named like a plugin or a policy
    (:data:`PLUGIN_OR_POLICY`: ``algo.x = ...``, ``self.policy.engine = ...``, ``setattr(algo, "x", ...)``)."""
    found = []

    def owner(node) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        return None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and node.args and owner(node.args[0]) in PLUGIN_OR_POLICY):
            found.append((node.lineno, f"setattr({owner(node.args[0])}, ...)"))
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and owner(t.value) in PLUGIN_OR_POLICY:
                    found.append((t.lineno, f"{owner(t.value)}.{t.attr}"))
    return found


def writes_into_plugins_or_policies(root: Path = ROOT) -> list[str]:
    """Every attribute write into a plugin or a policy from library code outside the modules that define them
    (prefzoo/algos/ and prefzoo/models/policy.py write their own objects' state through ``self``, which this does not
    report). Tests and benchmarks are outside its scope on purpose: they instrument objects (timers, counters, a
    fixed end-of-sequence id) the way any test double does; the rule is about the library composing its parts."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, what in attribute_writes(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(root.parent)}:{line} writes {what}")
    return found


def test_nothing_writes_into_a_plugin_or_a_policy():
    """The loop composes (issue 47): what the loop gives a plugin or a policy is an argument (the step's
    :class:`~prefzoo.types.StepContext`, the engine stack and the data-parallel forward at construction), never an
    attribute written into it from outside its module."""
    assert writes_into_plugins_or_policies() == []


def test_the_attribute_write_guard_fires():
    """The guard itself, on the writes the loop used to make."""
    code = ("self.algo.all_reduce = f\nalgo.draw_prompts = g\nself.policy.engine, x = e, 1\n"
            "self.policy.train_forward = m\nsetattr(algo, 'statistics', s)\nengine.step = 3\n")
    assert [w for _, w in attribute_writes(ast.parse(code))] == [
        "algo.all_reduce", "algo.draw_prompts", "policy.engine", "policy.train_forward", "setattr(algo, ...)"]
