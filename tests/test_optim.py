"""Each server-side rule against a reference written out here or torch.optim, step by step;
learning-rate schedules; one-line errors for bad optimizer settings."""

import numpy as np
import pytest
import torch

from distbelief.errors import UserError
from distbelief.ps.optim import SGD, Adagrad, Momentum, make_rule
from distbelief.ps.schedules import CONSTANT, Schedule, parse_schedule
from distbelief.ps.torchrule import TorchRule, parse_optimizer_args


def grads(n_steps, size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(n_steps)]


def run(rule, p0, gs):
    p, state = p0.copy(), rule.init_state(p0.size)
    for g in gs:
        rule.apply(p, g, state)
    return p, state


def test_sgd_matches_reference():
    p0, gs = np.ones(5, np.float32), grads(4, 5)
    p, _ = run(SGD(0.1), p0, gs)
    ref = p0.astype(np.float64)
    for g in gs:
        ref = ref - 0.1 * g
    np.testing.assert_allclose(p, ref, rtol=1e-6)


def test_momentum_matches_reference_and_torch():
    p0, gs = np.linspace(-1, 1, 6, dtype=np.float32), grads(5, 6, seed=1)
    p, state = run(Momentum(0.05, momentum=0.9), p0, gs)
    ref, v = p0.astype(np.float64), np.zeros(6)
    for g in gs:
        v = 0.9 * v + g
        ref = ref - 0.05 * v
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state["velocity"], v, rtol=1e-5, atol=1e-7)
    t = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.SGD([t], lr=0.05, momentum=0.9)
    for g in gs:
        t.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(p, t.detach().numpy(), rtol=1e-5, atol=1e-7)


def test_adagrad_matches_paper_formula():
    # DistBelief: eta_i,K = gamma / sqrt(sum_j g_i,j^2), here with eps inside the root.
    p0, gs = np.zeros(4, np.float32), grads(6, 4, seed=2)
    lr, eps = 0.5, 1e-8
    p, state = run(Adagrad(lr, eps=eps), p0, gs)
    ref, acc = np.zeros(4), np.zeros(4)
    for g in gs:
        acc = acc + g.astype(np.float64) ** 2
        ref = ref - lr / np.sqrt(eps + acc) * g
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["accumulator"], acc, rtol=1e-5)


def test_adagrad_first_step_is_lr_times_sign():
    p, _ = run(Adagrad(0.1), np.zeros(3, np.float32), [np.array([4.0, -0.5, 2.0], np.float32)])
    np.testing.assert_allclose(p, [-0.1, 0.1, -0.1], rtol=1e-6)


def test_rules_work_on_gathered_rows():
    rule = make_rule("adagrad", 0.1, rows=True)  # the rule gathered rows get
    params = np.ones((5, 3), np.float32)
    state = {"accumulator": np.zeros((5, 3), np.float32)}
    rows = np.array([1, 3])
    p, s = params[rows], {"accumulator": state["accumulator"][rows]}
    rule.apply(p, np.ones((2, 3), np.float32), s)
    params[rows], state["accumulator"][rows] = p, s["accumulator"]
    assert np.allclose(params[[0, 2, 4]], 1.0) and np.allclose(params[rows], 0.9)


def test_chunked_rules_equal_whole_array_numpy_bit_for_bit():
    # Sizes around and across chunk boundaries, plus a non-contiguous view (unchunked path).
    from distbelief.ps.optim import CHUNK

    rng = np.random.default_rng(5)
    for n in (1, CHUNK - 1, CHUNK, 2 * CHUNK + 7):
        p0 = rng.standard_normal(n).astype(np.float32)
        gs = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
        lr, mu, eps = np.float32(0.05), np.float32(0.9), np.float32(1e-8)
        sgd, v, acc = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        mom, ada = p0.copy(), p0.copy()
        for g in gs:
            sgd -= lr * g
            v *= mu
            v += g
            mom -= lr * v
            acc += g * g
            ada -= lr * (g / np.sqrt(acc + eps))
        for rule, ref in ((SGD(0.05), sgd), (Momentum(0.05, momentum=0.9), mom),
                          (Adagrad(0.05, eps=1e-8), ada)):
            p, _ = run(rule, p0, gs)
            np.testing.assert_array_equal(p, ref)
    strided = np.zeros(10, np.float32)[::2]
    Adagrad(0.1).apply(strided, np.ones(5, np.float32), {"accumulator": np.zeros(5, np.float32)})
    np.testing.assert_allclose(strided, -0.1, rtol=1e-6)


# --- torch.optim on the shards (issue 17) -------------------------------------------------

# --optimizer NAME [--optimizer-arg ...] -> the torch optimizer it must equal on a whole tensor
TORCH_EQUIVALENTS = {
    "adam": ([], torch.optim.Adam, {}),
    "adamw": (["weight_decay=0.05"], torch.optim.AdamW, {"weight_decay": 0.05}),
    "rmsprop": ([], torch.optim.RMSprop, {}),
    "nesterov": ([], torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "sgd": ([], torch.optim.SGD, {}),
    "momentum": ([], torch.optim.SGD, {"momentum": 0.9}),
    "adagrad": ([], torch.optim.Adagrad, {"eps": 0.0, "initial_accumulator_value": 1e-8}),
    "Adagrad": (["initial_accumulator_value=0.1"], torch.optim.Adagrad,
                {"initial_accumulator_value": 0.1}),
    "adamax": ([], torch.optim.Adamax, {}),
    "NAdam": ([], torch.optim.NAdam, {}),
    "radam": (["betas=0.8,0.99"], torch.optim.RAdam, {"betas": (0.8, 0.99)}),
    "ASGD": ([], torch.optim.ASGD, {}),
    "Rprop": ([], torch.optim.Rprop, {}),
    "adam-amsgrad": (["amsgrad=true", "eps=1e-6"], torch.optim.Adam,
                     {"amsgrad": True, "eps": 1e-6}),
}


def torch_whole(cls, kwargs, p0, gs, lr, factors=None):
    """``cls`` stepped over the whole tensor ``p0`` with grads ``gs`` (lr times factors)."""
    t = torch.from_numpy(p0.copy())
    opt = cls([t], lr=lr, foreach=False, **kwargs)
    for k, g in enumerate(gs):
        opt.param_groups[0]["lr"] = lr * (1.0 if factors is None else factors[k])
        t.grad = torch.from_numpy(g.copy())
        opt.step()
    return t.numpy()


def sliced(rule_factory, p0, gs, bounds, updates=True):
    """A fresh rule per slice ``p0[lo:hi]`` (as shards do), stepped through ``gs``."""
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        rule, p = rule_factory(), p0[lo:hi].copy()
        state = rule.init_state(p.size)
        for k, g in enumerate(gs):
            rule.apply(p, g[lo:hi].copy(), state, update=k if updates else None)
        out.append(p)
    return np.concatenate(out)


@pytest.mark.parametrize("name", sorted(TORCH_EQUIVALENTS))
def test_rule_on_slices_equals_torch_optim_on_whole_tensor(name):
    args, cls, kwargs = TORCH_EQUIVALENTS[name]
    rng = np.random.default_rng(7)
    p0 = rng.standard_normal(300).astype(np.float32)
    gs = [rng.standard_normal(300).astype(np.float32) * 0.1 ** (k % 3) for k in range(8)]
    ref = torch_whole(cls, kwargs, p0, gs, lr=0.05)
    rule_name = name.partition("-")[0]
    whole = sliced(lambda: make_rule(rule_name, 0.05, args=args), p0, gs, [0, 300])
    two = sliced(lambda: make_rule(rule_name, 0.05, args=args), p0, gs, [0, 117, 300])
    np.testing.assert_allclose(whole, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(two, ref, rtol=1e-6, atol=1e-6)
    assert not np.allclose(ref, p0)  # the optimizer moved the parameters


def test_numpy_rules_equal_torch_rules_to_1e6():
    # The NumPy rules kept for row-sparse tables and dense momentum/adagrad vs torch's path.
    rng = np.random.default_rng(11)
    p0 = rng.standard_normal(1000).astype(np.float32)
    gs = [rng.standard_normal(1000).astype(np.float32) for _ in range(10)]
    pairs = [(SGD(0.03), TorchRule(torch.optim.SGD, 0.03)),
             (Momentum(0.03, momentum=0.9), TorchRule(torch.optim.SGD, 0.03, {"momentum": 0.9})),
             (Adagrad(0.03), TorchRule(torch.optim.Adagrad, 0.03,
                                       {"eps": 0.0, "initial_accumulator_value": 1e-8}))]
    for numpy_rule, torch_rule in pairs:
        p_np, _ = run(numpy_rule, p0, gs)
        p_t, _ = run(torch_rule, p0, gs)
        np.testing.assert_allclose(p_np, p_t, rtol=1e-6, atol=1e-6)


def test_dense_rule_choice():
    # torch's fused kernels are faster than the NumPy rules on dense slices (bench/optim.py)
    assert isinstance(make_rule("momentum", 0.1), TorchRule)
    assert isinstance(make_rule("adagrad", 0.1), TorchRule)
    assert isinstance(make_rule("sgd", 0.1), TorchRule)
    assert make_rule("sgd", 0.1).state_names == ()  # as the NumPy SGD's: old checkpoints fit
    assert make_rule("adagrad", 0.1, args={"eps": "1e-6"}).kwargs == {
        "eps": 0.0, "initial_accumulator_value": 1e-6}
    # gathered rows and ranges keep the NumPy rules
    assert isinstance(make_rule("momentum", 0.1, rows=True), Momentum)
    assert make_rule("adagrad", 0.1, args={"eps": "1e-6"}, rows=True).eps == 1e-6
    assert make_rule("adam", 0.1).state_names == ("step", "exp_avg", "exp_avg_sq")
    assert make_rule("adam", 0.1).scalar_names == ("step",)
    assert make_rule("NAdam", 0.1).scalar_names == ("step", "mu_product")
    assert make_rule("nesterov", 0.1, momentum=0.5).kwargs == {"momentum": 0.5, "nesterov": True}


def test_torch_rule_is_zero_copy_over_the_shards_arrays():
    rule = make_rule("adam", 0.01)
    p, g = np.ones(50, np.float32), np.full(50, 0.5, np.float32)
    state = rule.init_state(50)
    assert state["step"].shape == (1,) and state["exp_avg"].shape == (50,)
    g.flags.writeable = False  # as a pushed gradient from the object store
    rule.apply(p, g, state)
    binding = rule._binding
    assert binding.tensor.data_ptr() == p.ctypes.data
    live = binding.opt.state[binding.tensor]
    for name, array in state.items():
        assert live[name].data_ptr() == array.ctypes.data
    assert state["step"][0] == 1 and np.all(state["exp_avg"] != 0) and np.all(p < 1)
    assert binding.tensor.grad is None  # the pushed buffer is not kept
    before = p.copy()
    rule.apply(p, g, state)  # same arrays: same binding, state advanced in place
    assert rule._binding is binding and state["step"][0] == 2 and np.all(p < before)


@pytest.mark.parametrize("name", ["adam", "NAdam", "rmsprop", "nesterov", "ASGD", "Adagrad",
                                  "Rprop"])
def test_restored_state_continues_bit_for_bit(name):
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(64).astype(np.float32)
    gs = [rng.standard_normal(64).astype(np.float32) for _ in range(8)]
    straight, _ = run(make_rule(name, 0.02), p0, gs)
    first = make_rule(name, 0.02)
    p, state = run(first, p0, gs[:4])
    saved = {"params": p.copy(), **{k: v.copy() for k, v in state.items()}}
    rule = make_rule(name, 0.02)  # a restarted shard: fresh rule, fresh arrays, copyto
    params, fresh = np.zeros(64, np.float32), rule.init_state(64)
    np.copyto(params, saved["params"])
    for k in fresh:
        np.copyto(fresh[k], saved[k])
    for g in gs[4:]:
        rule.apply(params, g, fresh)
    np.testing.assert_array_equal(params, straight)


def test_shard_core_checkpoints_torch_state_unchanged(tmp_path):
    from distbelief.checkpoint import load_arrays
    from distbelief.ps.shard import ShardCore

    rng = np.random.default_rng(4)
    init = rng.standard_normal(40).astype(np.float32)
    gs = [rng.standard_normal(40).astype(np.float32) for _ in range(6)]
    straight = ShardCore(0, init, make_rule("adamw", 0.01))
    for g in gs:
        straight.push(g, straight.version)
    core = ShardCore(0, init, make_rule("adamw", 0.01))
    for g in gs[:3]:
        core.push(g, core.version)
    core.save(str(tmp_path / "s.safetensors"))
    again = ShardCore(0, np.zeros(40, np.float32), make_rule("adamw", 0.01))
    arrays = load_arrays(tmp_path / "s.safetensors")
    assert set(arrays) == {"params", "step", "exp_avg", "exp_avg_sq"}
    again.restore(arrays, int(arrays["step"][0]))
    for g in gs[3:]:
        again.push(g, again.version)
    np.testing.assert_array_equal(again.params, straight.params)
    assert again.state["step"][0] == 6


def test_parse_optimizer_args_and_typing():
    assert parse_optimizer_args(["betas=0.9,0.99", "weight-decay=0.01"]) == {
        "betas": "0.9,0.99", "weight_decay": "0.01"}
    rule = make_rule("adam", 0.01, args=["betas=0.9,0.99", "weight_decay=0.01",
                                         "amsgrad=true", "eps=1e-6"])
    assert rule.kwargs == {"betas": (0.9, 0.99), "weight_decay": 0.01, "amsgrad": True,
                           "eps": 1e-6}
    assert make_rule("adam", 0.01, args={"betas": [0.8, 0.9]}).kwargs == {"betas": (0.8, 0.9)}
    assert make_rule("sgd", 0.1, args=["momentum=0.5", "dampening=0.1"]).kwargs == {
        "momentum": 0.5, "dampening": 0.1}


BAD_OPTIMIZERS = [
    ({"name": "adamm"}, "--optimizer 'adamm' is unknown"),
    ({"name": "lbfgs"}, "LBFGS needs a closure"),
    ({"name": "SparseAdam"}, "only sparse gradients"),
    ({"name": "adam", "args": ["beta=0.9"]}, "--optimizer-arg beta: torch.optim.Adam"),
    ({"name": "adam", "args": ["betas=1.5,0.9"]}, "Invalid beta parameter"),
    ({"name": "adam", "args": ["betas=0.9"]}, "pass 2 comma-separated numbers"),
    ({"name": "adam", "args": ["amsgrad=maybe"]}, "pass true or false"),
    ({"name": "adam", "args": ["eps=-1"]}, "--optimizer adam --optimizer-arg"),
    ({"name": "adam", "args": ["weight_decay=x"]}, "not a finite number"),
    ({"name": "adam", "args": ["lr=0.1"]}, "use --lr"),
    ({"name": "adam", "args": ["foreach=true"]}, "drop it"),
    ({"name": "adam", "args": ["betas"]}, "write KEY=VALUE"),
    ({"name": "adam", "args": ["eps=1", "eps=2"]}, "given twice"),
    ({"name": "adam", "lr": -0.1}, "--lr must be a finite number > 0"),
    ({"name": "adam", "lr": float("nan")}, "--lr must be a finite number > 0"),
    ({"name": "nesterov", "momentum": 1.5}, "--momentum must be in [0, 1)"),
    ({"name": "nesterov", "momentum": 0.0}, "Nesterov momentum requires a momentum"),
    ({"name": "nesterov", "args": ["momentum=0.5"]}, "use --momentum"),
    ({"name": "adagrad", "args": ["lr_decay=0.1"]}, "use --optimizer Adagrad"),
    ({"name": "adagrad", "args": ["eps=0"]}, "--optimizer-arg eps=0"),
    ({"name": "adam", "rows": True}, "cannot update row-sparse tables"),
    ({"name": "nesterov", "rows": True}, "use sgd, momentum, adagrad"),
    ({"name": "sgd", "rows": True, "args": ["weight_decay=0.1"]}, "takes no arguments"),
    ({"name": "adam", "schedule": "warmup:0"}, "--lr-schedule"),
]


@pytest.mark.parametrize("kwargs,message", BAD_OPTIMIZERS)
def test_bad_optimizer_settings_are_one_line_user_errors(kwargs, message):
    kwargs = {"lr": 0.1} | kwargs
    with pytest.raises(UserError) as info:
        make_rule(kwargs.pop("name"), kwargs.pop("lr"), **kwargs)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert "--optimizer" in text or "--lr" in text or "--momentum" in text


def test_row_rules_are_numpy_rules():
    for name in ("sgd", "momentum", "adagrad"):
        rule = make_rule(name, 0.1, rows=True, schedule="step:5:0.5")
        assert isinstance(rule, SGD) and rule.rows_ok and rule.schedule.decay == "step"
    assert not make_rule("adam", 0.1).rows_ok


# --- learning-rate schedules ---------------------------------------------------------------

def test_schedule_factors_by_hand():
    warm = parse_schedule("warmup:4")
    assert [warm.factor(k) for k in (0, 1, 2, 3, 4, 100)] == [0.25, 0.5, 0.75, 1, 1, 1]
    cos = parse_schedule("warmup:4,cosine:10")
    assert cos.factor(3) == 1.0 and cos.factor(4) == 1.0
    assert cos.factor(9) == pytest.approx(0.5) and cos.factor(14) == pytest.approx(0.0)
    assert cos.factor(6) == pytest.approx(0.5 * (1 + np.cos(np.pi * 0.2)))
    assert cos.factor(1000) == pytest.approx(0.0)
    floor = parse_schedule("cosine:10:0.1")
    assert floor.factor(5) == pytest.approx(0.55) and floor.factor(50) == pytest.approx(0.1)
    step = parse_schedule("step:3:0.5")
    assert [step.factor(k) for k in range(8)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]
    both = parse_schedule(" warmup:2 , step:3:0.1 ")
    assert [both.factor(k) for k in (0, 1, 2, 4, 5)] == pytest.approx([0.5, 1, 1, 1, 0.1])
    assert parse_schedule("") == parse_schedule("constant") == CONSTANT
    assert CONSTANT.constant and not warm.constant and CONSTANT.factor(10**9) == 1.0
    for text in ("warmup:100,cosine:5000", "step:1000:0.5", "cosine:20:0.01", "constant"):
        assert str(parse_schedule(text)) == text
    assert Schedule(warmup=3) == parse_schedule("warmup:3")


@pytest.mark.parametrize("text", ["warmup", "warmup:0", "warmup:1.5", "warmup:-3",
                                  "cosine:10,warmup:5", "cosine:10,step:5:0.5", "linear:10",
                                  "cosine:", "cosine:10:2", "cosine:10:nan", "step:10",
                                  "step:10:0", "step:10:1.5", "step:x:0.5", "cosine:1:2:3"])
def test_bad_schedules_are_one_line_user_errors(text):
    with pytest.raises(UserError) as info:
        parse_schedule(text)
    assert str(info.value).startswith(f"--lr-schedule {text!r}") and "\n" not in str(info.value)


@pytest.mark.parametrize("name,cls,kwargs", [("adam", torch.optim.Adam, {}),
                                             ("momentum", torch.optim.SGD, {"momentum": 0.9})])
def test_scheduled_rule_equals_torch_with_lambda_lr(name, cls, kwargs):
    schedule = parse_schedule("warmup:3,cosine:6:0.1")
    rng = np.random.default_rng(8)
    p0 = rng.standard_normal(100).astype(np.float32)
    gs = [rng.standard_normal(100).astype(np.float32) for _ in range(12)]
    t = torch.from_numpy(p0.copy())
    opt = cls([t], lr=0.1, foreach=False, **kwargs)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)
    for g in gs:
        t.grad = torch.from_numpy(g.copy())
        opt.step()
        lambda_lr.step()
    ours = sliced(lambda: make_rule(name, 0.1, schedule=schedule), p0, gs, [0, 40, 100])
    np.testing.assert_allclose(ours, t.numpy(), rtol=1e-6, atol=1e-6)
    unscheduled = sliced(lambda: make_rule(name, 0.1), p0, gs, [0, 100], updates=False)
    assert not np.allclose(unscheduled, ours)


def test_scheduled_rule_needs_the_update_count():
    for rule in (make_rule("adam", 0.1, schedule="warmup:5"),
                 make_rule("momentum", 0.1, schedule="warmup:5")):
        with pytest.raises(TypeError, match="update count"):
            rule.apply(np.zeros(3, np.float32), np.ones(3, np.float32), rule.init_state(3))
    assert make_rule("adam", 0.1, schedule="warmup:4").lr_at(1) == pytest.approx(0.05)


LEAN_SCRIPT = """
import hashlib, sys
import numpy as np
from distbelief.ps import torchrule
if sys.argv[1] == "lean":
    torchrule.without_compiler()
digest = hashlib.sha256()
for name, cls in sorted(torchrule.optimizer_classes().items()):
    rule = torchrule.TorchRule(cls, 0.01)
    p, state = np.linspace(-1, 1, 50, dtype=np.float32), rule.init_state(50)
    for k in range(3):
        rule.apply(p, np.full(50, k - 1.0, np.float32), state)
    opt = rule._binding.opt
    opt.load_state_dict(opt.state_dict())
    opt.zero_grad()
    digest.update(p.tobytes() + b"".join(state[n].tobytes() for n in rule.state_names))
print(digest.hexdigest(), type(sys.modules.get("torch._dynamo")).__name__)
import torch
torch._dynamo.disable(print)  # anything but graph_break imports the real compiler
print(type(sys.modules["torch._dynamo"]).__name__, torch._dynamo.reset.__module__)
"""


def test_without_the_compiler_every_torch_rule_steps_the_same_and_it_loads_on_demand():
    """A shard process runs torch.optim without importing torch._dynamo (1.1 s of CPU at
    each shard start): every element-wise rule gives bit-identical steps, state_dict and
    load_state_dict round trips as with it; asking for anything else loads the real one.
    Run in fresh processes: the switch is for the whole process."""
    import subprocess
    import sys

    def run(mode):
        proc = subprocess.run([sys.executable, "-c", LEAN_SCRIPT, mode], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    lean, full = run("lean"), run("full")
    assert lean[0] == full[0]  # same parameters and state, bit for bit, for every rule
    assert lean[1] == "_CompilerOnDemand" and full[1] == "module"
    assert lean[2:] == full[2:] and lean[2] == "module"  # the real module, on demand
