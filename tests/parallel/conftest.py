"""Shared by the CLI-curve tests (test_cli.py, test_graduation.py): a small corpus of random sentences."""
import pytest
import torch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(directory, {"data.path", "data.data_dir"}): 200 seeded sentences from a 17-word vocabulary."""
    d = tmp_path_factory.mktemp("corpus")
    words = "the king and queen of night shall speak to thee my lord what art thou sweet love".split()
    g = torch.Generator().manual_seed(0)
    text = "".join(" ".join(words[i] for i in torch.randint(0, len(words), (6,), generator=g)) + ".\n"
                   for _ in range(200))
    (d / "corpus.txt").write_text(text)
    torch.set_num_threads(1)
    return d, {"data.path": str(d / "corpus.txt"), "data.data_dir": str(d / "data")}
