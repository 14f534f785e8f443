"""Shell wrappers we generate around entrypoints, written for POSIX sh (dash included).

`cmd 2>&1 | tee log` reports tee's exit status, not the command's, and dash has no
`pipefail`: a failed training run looked successful in the source PR. The wrapper here
carries the command's status out of the pipeline through a spare file descriptor instead.
"""

from __future__ import annotations

import shlex


def tee_command(command: str, log_path: str) -> str:
    """A one-line POSIX-sh script that runs `command`, appends its output (stdout and stderr
    merged) to `log_path` while still printing it, and exits with the command's exit status.

    The command runs in its own `sh -c` (so a trailing comment or an `exit n` in it behaves)
    with the helper descriptors closed, so a daemon it leaves behind cannot hold the status
    pipe open (one that keeps stdout open keeps tee running, as with any pipe). One line,
    because entrypoints travel through other shells (KubeRay's submitter, Ray's job API). The
    log's directory is created if missing; the log is appended to, so retries keep history.
    """
    if not command.strip():
        raise ValueError("tee_command: command is empty")
    if not log_path:
        raise ValueError("tee_command: log_path is empty")
    log = shlex.quote(log_path)
    script = shlex.quote(command)
    if "\n" in command:  # keep it one line: printf %b turns the escaped newlines back
        escaped = command.replace("\\", "\\\\").replace("\n", "\\n")
        script = f"\"$(printf '%b' {shlex.quote(escaped)})\""
    return (
        f'mkdir -p "$(dirname {log})" && exec 4>&1 && '
        f"__prefect_nemo_rc=$( {{ {{ sh -c {script} 3>&- 4>&-; "
        f"printf '%s' \"$?\" >&3; }} 2>&1 | tee -a {log} >&4; }} 3>&1 ); "
        'exec 4>&-; exit "${__prefect_nemo_rc:-1}"'
    )
