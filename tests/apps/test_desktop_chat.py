"""The desktop chat window on a real X server (Xvfb) with the real default model: send a
message, watch it stream, press Stop, switch to SD, get a reply there, and save a screenshot
(copied to $MIRROR_MLX_SCREENSHOT_DIR when that is set)."""

import os
import re
import shutil
import subprocess
import time

import pytest

tk = pytest.importorskip("tkinter", reason="this Python has no tkinter")
if shutil.which("Xvfb") is None:
    pytest.skip("Xvfb is not installed (./install.sh --test installs it)",
                allow_module_level=True)

from PIL import ImageGrab  # noqa: E402

from apps.desktop_chat.window import ChatWindow  # noqa: E402


@pytest.fixture()
def display(monkeypatch):
    """A private X display for this test."""
    for number in range(90, 140):
        if not os.path.exists(f"/tmp/.X11-unix/X{number}") and \
                not os.path.exists(f"/tmp/.X{number}-lock"):
            break
    name = f":{number}"
    server = subprocess.Popen(["Xvfb", name, "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not os.path.exists(f"/tmp/.X11-unix/X{number}"):
        assert server.poll() is None, server.stderr.read().decode()
        assert time.monotonic() < deadline, "Xvfb did not start"
        time.sleep(0.05)
    monkeypatch.setenv("DISPLAY", name)
    yield name
    server.terminate()
    server.wait(timeout=10)
    server.stderr.close()


def pump(root, condition, timeout: float = 60.0) -> None:
    """Run Tk's event loop until `condition()` holds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        root.update()
        time.sleep(0.01)


def live_tokens(status: str) -> int:
    found = re.search(r"(\d+) tokens", status)
    return int(found.group(1)) if found else 0


def click(root, button) -> None:
    """A left click as the X server delivers it: press and release over the button."""
    x, y = button.winfo_width() // 2, button.winfo_height() // 2
    button.event_generate("<Enter>", x=x, y=y)
    button.event_generate("<ButtonPress-1>", x=x, y=y)
    button.event_generate("<ButtonRelease-1>", x=x, y=y)
    root.update()


def test_stream_stop_switch_mode_and_screenshot(display, target, tmp_path):
    root = tk.Tk()
    app = ChatWindow(root, target, max_tokens=200)
    try:
        pump(root, lambda: root.winfo_viewable())
        app.entry.focus_force()
        root.update()
        app.entry.insert(0, "Write a long story about a dragon.")
        app.entry.event_generate("<Return>")
        pump(root, lambda: app.generating)
        assert str(app.stop_button["state"]) == "normal"
        assert str(app.send_button["state"]) == "disabled"
        pump(root, lambda: live_tokens(app.status.get()) >= 3)
        assert app.status.get().startswith("Mirror-SD · ") and "tok/step" in app.status.get()
        click(root, app.stop_button)
        pump(root, lambda: not app.generating, 30)
        assert app.last_stats.finish_reason == "cancelled"
        assert app.last_stats.generated_tokens < 50
        transcript = app.transcript.get("1.0", "end")
        assert "You: Write a long story about a dragon." in transcript
        assert "[stopped]" in transcript

        click(root, app.mode_buttons["sd"])
        pump(root, lambda: app.status.get() == "mode SD")
        assert app.engine.mode == "sd" and app.mode_var.get() == "sd"
        app.entry.insert(0, "Name three colors.")
        click(root, app.send_button)
        pump(root, lambda: app.generating)
        pump(root, lambda: not app.generating, 120)
        stats = app.last_stats
        assert stats.mode == "sd" and stats.finish_reason in ("stop", "length")
        status = app.status.get()
        assert status.startswith("SD · ") and f"{stats.acceptance_length:.2f} tok/step" in status
        # The conversation went on across the switch: the second reply saw the first exchange.
        assert stats.prompt_tokens > len(app.engine.encode("Name three colors."))
        reply = app.transcript.get("1.0", "end").split("Assistant: ")[-1].strip()
        assert reply

        root.update()
        x, y = root.winfo_rootx(), root.winfo_rooty()
        shot = ImageGrab.grab(bbox=(x, y, x + root.winfo_width(), y + root.winfo_height()),
                              xdisplay=display)
    finally:
        app.close()
    assert shot.size == (720, 480)
    # A drawn window, not a blank frame: background, text and widget colors.
    assert len(shot.getcolors(maxcolors=1 << 16) or ()) > 20
    path = tmp_path / "desktop_chat.png"
    shot.save(path)
    if os.environ.get("MIRROR_MLX_SCREENSHOT_DIR"):
        shutil.copy(path, os.environ["MIRROR_MLX_SCREENSHOT_DIR"])
