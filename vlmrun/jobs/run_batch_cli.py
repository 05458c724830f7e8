"""`vlmrun run-batch`: OpenAI batch JSONL in, one answer per request out (vLLM's `run-batch`), resumably.

    vlmrun run-batch -i IN.jsonl [-o OUT.jsonl] [--model M] [engine and server options]
                     [--resume | --overwrite] [--retry-errors] [--max-in-flight N]

Each input line is a request, `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`, answered as `vlmrun serve` answers that body (same validation,
image and URL policy); each output line is `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`, written in input order (a line waits only for earlier ones still in
flight; a line longer than --max-request-mb plus 64 KiB is answered 413 without being read whole). A
rerun with the same -o skips the custom_ids already answered. -o - (or no -o) writes the lines to
stdout. Exit status, of this run (vLLM's): 0 every line was written, failed requests included (their
error lines say why), 1 the output could not be written, 2 bad usage or the job could not start (an -o
that is not a run-batch output, or is the input, is refused untouched), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from vlmrun.jobs.cli import EXIT_USAGE, sigterm_as_interrupt
from vlmrun.server.cli import add_engine_args, add_server_args, engine_config, server_settings
from vlmrun.server.vllm_flags import announce_accepted, check_tokenizer, show_server_logs


def build_config(args: argparse.Namespace):  # -> RunBatchConfig (imported lazily: torch)
    """The job the parsed command line asks for (ValueError for bad values)."""
    from vlmrun.default_model import resolve_model
    from vlmrun.jobs.run_batch import RunBatchConfig

    if args.api_key is not None:
        raise ValueError("--api-key does not apply to run-batch (it has no clients to authenticate)")
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    settings = server_settings(args)
    named = args.model
    args.model = resolve_model(args.model)
    check_tokenizer(args.tokenizer, named, args.model)
    announce_accepted(args, "run-batch")
    show_server_logs(settings.log_requests, log_stats=False)  # (its own progress line says how it goes)
    return RunBatchConfig(input=args.input_file, engine=engine_config(args), settings=settings,
                          out=args.output_file, max_in_flight=args.max_in_flight, overwrite=args.overwrite,
                          retry_errors=args.retry_errors, fsync_interval=args.fsync_interval)


def run_batch(args: argparse.Namespace) -> int:
    from vlmrun.jobs.journal import NotAJournalError
    from vlmrun.jobs.run_batch import run_batch_job
    from vlmrun.jobs.sink import OutputError

    try:
        config = build_config(args)
        with sigterm_as_interrupt():
            summary = run_batch_job(config)
    except (OutputError, NotAJournalError, ValueError, OSError, ImportError) as exc:
        print(f"vlmrun run-batch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in summary.lines():
        print(line, file=sys.stderr)
    return summary.exit_code()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="answer a file of OpenAI batch requests (vLLM's run-batch format)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, metavar="IN",
                   help="JSONL of requests, one per line: custom_id, method, url, body")
    p.add_argument("-o", "--output-file", default=None, metavar="OUT",
                   help="JSONL of answers, one per request (- or none: stdout); an existing one is resumed")
    j = p.add_argument_group("job")
    mode = j.add_mutually_exclusive_group()
    mode.add_argument("--resume", dest="overwrite", action="store_false",
                      help="skip the requests already answered in -o (the default when it exists)")
    mode.add_argument("--overwrite", dest="overwrite", action="store_true", help="start -o afresh")
    j.add_argument("--retry-errors", action="store_true", help="on resume, send again the requests that failed")
    j.add_argument("--max-in-flight", type=int, default=None,
                   help="lines sent and not yet written (default: 2 x --max-num-seqs); bounds memory")
    j.add_argument("--fsync-interval", type=float, default=1.0,
                   help="seconds between fsyncs of the output (0: after every line)")
    add_engine_args(p.add_argument_group("engine"))
    add_server_args(p.add_argument_group("requests (as `vlmrun serve` takes them)"))
    p.set_defaults(func=run_batch, overwrite=False)
