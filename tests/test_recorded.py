"""minite.recorded: the lessons' reader of benchmarks/results, which must work where nothing is recorded."""
import json

from minite.recorded import RESULTS, recorded


def test_recorded_reads_one_concepts_files_sorted_and_nothing_else(tmp_path):
    (tmp_path / "gpt_step_124m_b-gpu.json").write_text(json.dumps({"device": "B"}))
    (tmp_path / "gpt_step_124m_a-gpu.json").write_text(json.dumps({"device": "A"}))
    (tmp_path / "attention_a-gpu.json").write_text(json.dumps({"device": "other"}))
    got = recorded("gpt_step_124m", tmp_path)
    assert list(got) == ["gpt_step_124m_a-gpu.json", "gpt_step_124m_b-gpu.json"]
    assert [v["device"] for v in got.values()] == ["A", "B"]


def test_recorded_is_empty_without_files_or_folder(tmp_path):
    assert recorded("gpt_step_124m", tmp_path) == {}
    assert recorded("gpt_step_124m", tmp_path / "absent") == {}


def test_the_course_records_the_h200_step_lesson_14_reads():
    run = recorded("gpt_step_124m", RESULTS)["gpt_step_124m_nvidia-h200.json"]
    assert run["device"] == "NVIDIA H200" and {r["impl"] for r in run["results"]} == {"minite", "nanoGPT model.py"}
