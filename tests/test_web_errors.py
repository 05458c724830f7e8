"""The web demo's error for a bad upload names the file, and the file leaves the input box (issue 29)."""

from __future__ import annotations

from vlmrun.processors.image_io import describe_source
from vlmrun.web.conversation import Turn, explain_error, media_part, without_files


def test_the_error_names_the_uploaded_file_and_only_it_leaves_the_box(tmp_path):
    paths = {}
    for name in ("cat.png", "clip.mp4", "broken.jpg", "dog.png"):
        paths[name] = str(tmp_path / name)
        (tmp_path / name).write_bytes(b"not really a " + name.encode())
    turns = [Turn("first", [paths["cat.png"]], answer="a cat"),
             Turn("second", [paths["clip.mp4"], paths["broken.jpg"], paths["dog.png"]])]

    def sent_as(name: str) -> str:  # how the server's processors name the upload the demo sent
        part = media_part(paths[name])
        return describe_source(part.get("image_url", part.get("video_url"))["url"])

    error = f"image 2 ({sent_as('broken.jpg')}): data URI is not a recognised image (looks like text)"
    text, bad = explain_error(error, turns)
    assert text == "'broken.jpg': the file is not a recognised image (looks like text)"
    assert bad == {paths["broken.jpg"]}
    text, bad = explain_error(f"video 1 ({sent_as('clip.mp4')}): cannot decode the video: Invalid data", turns)
    assert text == "'clip.mp4': cannot decode the video: Invalid data" and bad == {paths["clip.mp4"]}
    assert explain_error("image 9 (data URI (5 chars)): x", turns) == ("image 9 (data URI (5 chars)): x", set())
    assert explain_error("the prompt is too long", turns) == ("the prompt is too long", set())

    message = {"text": "second", "files": [{"path": paths["clip.mp4"]}, {"path": paths["broken.jpg"]},
                                          paths["dog.png"]]}
    assert without_files(message, {paths["broken.jpg"]}) == {
        "text": "second", "files": [{"path": paths["clip.mp4"]}, paths["dog.png"]]}
