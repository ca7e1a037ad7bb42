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


def test_recorded_for_prefers_the_device_then_the_h200_then_none(tmp_path):
    from minite.recorded import recorded_for
    (tmp_path / "lora_nvidia-h200.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    (tmp_path / "lora_nvidia-a100.json").write_text(json.dumps({"device": "NVIDIA A100"}))
    assert recorded_for("lora", "NVIDIA A100", tmp_path) == ("lora_nvidia-a100.json", {"device": "NVIDIA A100"})
    assert recorded_for("lora", "Some GPU", tmp_path)[0] == "lora_nvidia-h200.json"
    assert recorded_for("decode", "NVIDIA A100", tmp_path) is None
    (tmp_path / "lora_nvidia-h200.json").unlink()
    assert recorded_for("lora", "Some GPU", tmp_path) is None
    assert recorded_for("lora", None, tmp_path / "absent") is None
