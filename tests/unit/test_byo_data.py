"""Bring your own data and reward: the dataset task's records, order and errors; rewards by path; the math reward.

Real files throughout (JSONL written here, Parquet through pyarrow). Every bad input is one ConfigError whose
message names the file, the row or line, and the field.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.rewards import Reward, load_reward, resolve_function
from dynaresize.rewards.math import compute_score, extract_answer
from dynaresize.tasks import load_task
from dynaresize.tasks.base import TaskReward, sample_of
from dynaresize.tasks.config import DatasetConfig, TaskConfig
from dynaresize.tasks.dataset import DatasetError, DatasetTask

pytestmark = pytest.mark.unit


def record(i: int, chat: bool = True) -> dict:
    q = f"What is {i} plus 1?"
    return {"prompt": [{"role": "user", "content": q}] if chat else q, "data_source": "toy",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def dataset(train, val=(), **kw) -> DatasetTask:
    return DatasetTask(DatasetConfig(train_files=list(train), val_files=list(val), **kw))


# -- reading ------------------------------------------------------------------------------------------------


def test_parquet_and_jsonl_records_read_alike(tmp_path):
    rows = [record(i) for i in range(5)]
    a = dataset([write_parquet(tmp_path / "t.parquet", rows)], shuffle=False)
    b = dataset([write_jsonl(tmp_path / "t.jsonl", rows + [record(9, chat=False)])], shuffle=False)
    assert a.train == b.train[:5] and len(b.train) == 6
    s = a.train[0]
    assert s.prompt == [{"role": "user", "content": "What is 0 plus 1?"}] and s.is_chat
    assert (s.data_source, s.ground_truth, s.extra_info) == ("toy", "1", {"index": 0})
    assert b.train[5].prompt == "What is 9 plus 1?" and not b.train[5].is_chat  # a string prompt (not in one
    # Parquet column with chat lists: Arrow types a column once)
    strings = dataset([write_parquet(tmp_path / "s.parquet", [record(i, chat=False) for i in range(2)])])
    assert strings.train[1].prompt == "What is 1 plus 1?"
    assert a.chat_record() == f"{tmp_path / 't.parquet'}: row 0: field 'prompt'"
    assert dataset([write_jsonl(tmp_path / "s.jsonl", [record(1, chat=False)])]).chat_record() is None


def test_order_is_a_pure_function_of_seed_step_index_with_epochs(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [record(i) for i in range(10)])
    ds, again = dataset([path]), dataset([path])
    per_step = 4
    keys = [(s, i) for s in range(5) for i in range(per_step)]  # 20 positions: two epochs of 10
    rows = [ds.position(3, s, i, per_step) for s, i in keys]
    assert rows == [again.position(3, s, i, per_step) for s, i in keys]  # any process, any run
    assert sorted(rows[:10]) == sorted(rows[10:]) == list(range(10))  # each epoch visits every record once
    assert rows[:10] != rows[10:]  # reshuffled per epoch
    assert rows != [ds.position(4, s, i, per_step) for s, i in keys]  # the seed moves it
    assert [dataset([path], shuffle=False).position(0, s, i, per_step) for s, i in keys] == [p % 10 for p in range(20)]
    assert sample_of(ds, 3, 1, 2, per_step) == ds.train[ds.position(3, 1, 2, per_step)]


def test_epochs_bound_the_run(tmp_path):
    ds = dataset([write_jsonl(tmp_path / "t.jsonl", [record(i) for i in range(10)])], epochs=2)
    ds.check_run(steps=5, per_step=4)  # 20 prompts = 2 epochs
    with pytest.raises(DatasetError, match=r"task.dataset.epochs = 2: run.steps=6 x rollout.prompts_per_step=4 needs 24 prompts, 3 epochs"):
        ds.check_run(steps=6, per_step=4)


def test_validation_split_and_reference_answers(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [record(i) for i in range(3)])
    val = write_parquet(tmp_path / "v.parquet", [dict(record(i), extra_info={"answer": f"\\boxed{{{i + 1}}}"}) for i in range(6)])
    ds = dataset([train], [val], val_max_prompts=4)
    assert [s.ground_truth for s in ds.val_samples()] == ["1", "2", "3", "4"]
    assert ds.reference(ds.val[2]) == "\\boxed{3}" and ds.reference(ds.train[2]) == "3"


def test_dataset_task_by_config(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [record(i) for i in range(3)])
    cfg = load_config(None, ["task.name=dataset", f"task.dataset.train_files=[{path}]"])
    task = load_task(cfg.task)
    assert isinstance(task, DatasetTask) and len(task.train) == 3


# -- bad records: one message, file + row/line + field --------------------------------------------------------

BAD_RECORDS = [
    ({"data_source": "toy", "reward_model": {"ground_truth": "1"}}, "field 'prompt': missing"),
    (dict(record(0), prompt=""), "field 'prompt': empty string"),
    (dict(record(0), prompt=[]), "field 'prompt': empty list of chat messages"),
    (dict(record(0), prompt=7), "field 'prompt': must be a string or a list of chat messages, got int"),
    (dict(record(0), prompt=["hi"]), "field 'prompt[0]': a chat message must be an object"),
    (dict(record(0), prompt=[{"role": "user"}]), "field 'prompt[0].content': must be a string, got None"),
    (dict(record(0), prompt=[{"role": 1, "content": "x"}]), "field 'prompt[0].role': must be a string, got 1"),
    ({"prompt": "x", "data_source": "toy"}, "field 'reward_model': missing or not an object"),
    ({"prompt": "x", "data_source": "toy", "reward_model": {"style": "rule"}}, "field 'reward_model.ground_truth': missing"),
    ({"prompt": "x", "reward_model": {"ground_truth": "1"}}, "field 'data_source': must be a non-empty string, got None"),
    (dict(record(0), data_source=""), "field 'data_source': must be a non-empty string"),
    (dict(record(0), extra_info=[1, 2]), "field 'extra_info': must be an object (or absent), got [1, 2]"),
    ([1, 2], "a record must be an object with a 'prompt', got list"),
]


@pytest.mark.parametrize(("bad", "needle"), BAD_RECORDS)
def test_a_malformed_jsonl_record_names_file_line_and_field(tmp_path, bad, needle):
    path = write_jsonl(tmp_path / "train.jsonl", [record(0), record(1), bad])
    with pytest.raises(ConfigError) as e:
        dataset([path])
    assert str(e.value).startswith(f"{path}: line 3: ") and needle in str(e.value)
    assert "\n" not in str(e.value)  # one message, no traceback


def test_a_malformed_parquet_row_names_file_row_and_field(tmp_path):
    rows = [record(0), record(1), dict(record(2), reward_model={"style": "rule", "ground_truth": None})]
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DatasetError, match=rf"^{tmp_path}/train.parquet: row 2: field 'reward_model.ground_truth': missing$"):
        dataset([path])


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("t.jsonl", '{"prompt": "x", \n', "line 1: not valid JSON"),
        ("t.parquet", "not parquet at all", "not a readable Parquet file"),
        ("t.csv", "prompt\nx\n", "unknown dataset format '.csv'"),
        ("t.jsonl", "\n\n", "no records (task.dataset.train_files)"),
        ("t.jsonl", None, "no such dataset file"),
    ],
)
def test_bad_files_name_the_file(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError) as e:
        dataset([str(path)])
    assert str(e.value).startswith(str(path)) and needle in str(e.value)


def test_bad_validation_file_and_missing_train_files(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [record(0)])
    val = write_jsonl(tmp_path / "v.jsonl", [record(0), dict(record(1), prompt=None)])
    with pytest.raises(DatasetError, match=rf"{val}: line 2: field 'prompt': missing"):
        dataset([train], [val])
    with pytest.raises(DatasetError, match="task.dataset.train_files: empty"):
        load_task(TaskConfig(name="dataset"))


# -- rewards ------------------------------------------------------------------------------------------------


def boom(data_source, solution_str, ground_truth, extra_info):
    raise ZeroDivisionError("no luck")


def says_yes(data_source, solution_str, ground_truth, extra_info):
    return "yes"


def verl_dict(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.25, "acc": False}


def echo_args(data_source, solution_str, ground_truth, extra_info):
    return float(data_source == "toy" and solution_str == "r" and ground_truth == "7" and extra_info == {"i": 1})


def test_reward_by_import_path_gets_verls_arguments():
    r = load_reward(load_config(None, [f"reward.function={__name__}:echo_args"]))
    assert r.score("0.0.0", {"data_source": "toy", "ground_truth": "7", "extra_info": {"i": 1}}, "r").score == 1.0
    assert load_reward(load_config(None, ["reward.function=math"])).fn is compute_score
    assert Reward(verl_dict, "v").score("k", {}, "x").score == 0.25  # verl's dict form: its "score"


def test_reward_from_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_score.py").write_text("def compute_score(ds, sol, gt, extra):\n    return float(sol == gt)\n")
    monkeypatch.chdir(tmp_path)  # relative to the working directory, like verl's custom_reward_function.path
    r = load_reward(load_config(None, ["reward.function=my_score.py:compute_score"]))
    assert r.score("k", {"ground_truth": "7"}, "7").score == 1.0
    with pytest.raises(ConfigError, match="reward.function = 'nope.py:...': no such file"):
        resolve_function("nope.py:f")


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (boom, "sample 3.1.2: reward f raised ZeroDivisionError: no luck"),
        (says_yes, "sample 3.1.2: reward f returned 'yes', not a finite number"),
        (lambda *a: None, "returned None, not a finite number"),
        (lambda *a: float("nan"), "returned nan, not a finite number"),
        (lambda *a: True, "returned True, not a finite number"),
    ],
)
def test_a_failing_reward_scores_zero_and_names_the_sample(fn, needle):
    out = Reward(fn, "f").score("3.1.2", {"data_source": "toy", "ground_truth": "1"}, "resp")
    assert out.score == 0.0 and needle in out.error


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("nocolon", "expected 'module:function'"),
        ("no.such.module:f", "cannot import module 'no.such.module'"),
        ("dynaresize.rewards.math:nope", "has no attribute 'nope'"),
        ("dynaresize.rewards.math:_NUMBER", "not a function"),
    ],
)
def test_a_bad_reward_path_is_one_config_error(path, needle):
    with pytest.raises(ConfigError) as e:
        resolve_function(path)
    assert str(e.value).startswith(f"reward.function = {path!r}: ") and needle in str(e.value)


def test_a_dataset_without_reward_function_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [record(0)])
    cfg = load_config(None, ["task.name=dataset", f"task.dataset.train_files=[{path}]"])
    with pytest.raises(ConfigError, match="reward.function: unset, and task 'dataset' has no reward of its own"):
        load_reward(cfg)


def test_a_generated_task_keeps_its_own_reward():
    cfg = load_config(None, ["task.name=reverse_digits"])
    task = load_task(cfg.task)
    s = sample_of(task, 0, 3, 5, 8)
    assert s.prompt == "r:864=" and s.ground_truth == "468" and s.extra_info == {"prompt": "r:864="}
    assert load_reward(cfg).score("3.5.0", s.to_info(), "468").score == 1.0
    assert TaskReward(task)("x", "461", "468", {"prompt": "r:864="}) == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("3+4=7. \\boxed{7}", "7", 1.0),
        ("\\boxed{8} no wait \\boxed{7}", "7", 1.0),  # the last box counts
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so it is 1,200 eggs #### 1200", 1200, 1.0),
        ("The answer is 12.", "12", 1.0),
        ("we get 3 then 9", "9", 1.0),  # the last number
        ("\\boxed{50\\%}", "0.5", 1.0),
        ("\\boxed{7}", "8", 0.0),
        ("no number here", "7", 0.0),
        ("", "7", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),  # text compared normalised
        ("\\boxed{3}", ["2", "3"], 1.0),  # several accepted answers
        ("\\boxed{7", "7", 1.0),  # unclosed box: falls back to the last number
    ],
)
def test_math_reward(response, truth, score):
    assert compute_score("toy", response, truth) == score


def test_math_answer_extraction_order():
    assert extract_answer("1 then \\boxed{2} then 3") == "2"
    assert extract_answer("x #### 4\nmore 5") == "4"
    assert extract_answer("final answer: 6 apples") == "6 apples"
    assert extract_answer("nothing") is None
