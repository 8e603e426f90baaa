"""Class names for FusedOutput.top_label: the coordinator's ``labels`` / ``labels_file``
parameters (nodes/inference_common.load_labels)."""

from __future__ import annotations

import pytest

from kaitian_ros.nodes.inference_common import MAX_LABEL_CHARS, load_labels


def test_a_list_or_a_file_of_names_one_per_class(tmp_path) -> None:
    assert load_labels([], "", 10) == ()
    assert load_labels(["cat", "dog"], "", 2) == ("cat", "dog")
    path = tmp_path / "labels.txt"
    path.write_text(" cat \r\ndog\n\n\n", encoding="utf-8")  # spaces, CRLF and trailing blank lines
    assert load_labels([], str(path), 2) == ("cat", "dog")
    path.write_text("Käse\n猫\n", encoding="utf-8")
    assert load_labels([], str(path), 2) == ("Käse", "猫")


@pytest.mark.parametrize(("names", "content", "classes", "reason"), [
    (["a"], "a\n", 1, "not both"),
    ([], None, 2, "No such file"),
    ([], b"\xff\xfe\x00", 2, "not UTF-8"),
    ([], "a\nb\nc\n", 2, "has 3 names, the model has num_classes 2"),
    (["a", "b", "c"], "", 2, "labels has 3 names"),
    ([], "a\n\nb\n", 3, "class 1 has an empty name"),
    (["a", "x" * (MAX_LABEL_CHARS + 1)], "", 2, "class 1 has an overlong name"),
])
def test_what_does_not_fit_is_refused_with_the_reason(tmp_path, names, content, classes, reason) -> None:
    path = ""
    if content is not None and (content or not names):
        p = tmp_path / "labels.txt"
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        path = str(p)
    elif content is None:
        path = str(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=reason):
        load_labels(names, path, classes)
