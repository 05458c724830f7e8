"""The web demo's error for a bad upload names the file, and the file leaves the input box (issue 29)."""

from __future__ import annotations

from web.conversation import Turn, explain_error, without_files


def test_the_error_names_the_uploaded_file_and_only_it_leaves_the_box():
    turns = [Turn("first", ["/tmp/up/cat.png"], answer="a cat"),
             Turn("second", ["/tmp/up/clip.mp4", "/tmp/up/broken.jpg", "/tmp/up/dog.png"])]
    error = ("image 2 (data URI (38 chars)): data URI is not a recognised image (looks like text); "
             "supported formats: JPEG, PNG")
    text, bad = explain_error(error, turns)
    assert text.startswith("image 2 ('broken.jpg'): ") and "38 chars" not in text
    assert bad == {"/tmp/up/broken.jpg"}
    video_error = "video 1 (data URI (1,234 chars)): cannot decode the video: Invalid data"
    text, bad = explain_error(video_error.replace("1,234", "1234"), turns)
    assert text.startswith("video 1 ('clip.mp4'): ") and bad == {"/tmp/up/clip.mp4"}
    assert explain_error("image 9 (data URI (5 chars)): x", turns) == ("image 9 (data URI (5 chars)): x", set())
    assert explain_error("the prompt is too long", turns) == ("the prompt is too long", set())

    message = {"text": "second", "files": [{"path": "/tmp/up/clip.mp4"}, {"path": "/tmp/up/broken.jpg"},
                                          "/tmp/up/dog.png"]}
    assert without_files(message, {"/tmp/up/broken.jpg"}) == {
        "text": "second", "files": [{"path": "/tmp/up/clip.mp4"}, "/tmp/up/dog.png"]}
