// Command idemq administers idemq: its Postgres tables, dead-letter queues,
// benchmarks and the chaos suite.
//
// Usage:
//
//	idemq <command> [flags] [args]
//
// Commands:
//
//	migrate                          create or upgrade the dedup table
//	processed show <consumer> <id>   print one dedup record
//	processed purge --older-than D   delete dedup records older than D
//	dlq inspect                      summarise a dead-letter queue without consuming it
//	dlq replay                       republish dead letters through the dedup path, or --dry-run
//	status --consumer NAME           dedup table size, purge backlog, DLQ depth, last applied
//	bench                            throughput against baselines, side by side
//	chaos                            the chaos suite with an exactly-once checker
//	console                          serve the web console: dead letters by cause, dry runs, replays, audit
//	reconcile                        join outboxes and dedup tables across services: lost, doubled, stuck
//
// Every database command takes --database-url (defaulting to $DATABASE_URL,
// then postgres://postgres@127.0.0.1:5432/test?sslmode=disable), --schema and
// --table. Run `idemq <command> --help` for a command's flags.
//
// Exit status: 0 on success, 1 on failure (including a record not found, or
// discrepancies reconcile found), 2 on a usage error (or a reconciliation
// that could not run).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1
	exitUsage = 2
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// env is what a command runs with.
type env struct {
	stdout, stderr io.Writer
	// getenv reads the environment; tests may replace it.
	getenv func(string) string
}

// usageError is a command-line mistake: it exits 2 and points at --help.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// exitError ends a command with an exit code of its own and no pointer at
// --help: `idemq reconcile` exits 2 when it could not check, which a cron
// job must tell from 1, discrepancies found.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// run is main without the process: it parses args (without the program
// name), runs the command and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runEnv(ctx, args, &env{stdout: stdout, stderr: stderr, getenv: os.Getenv})
}

// runEnv is run with the environment read through e.getenv.
func runEnv(ctx context.Context, args []string, e *env) int {
	stdout, stderr := e.stdout, e.stderr
	if len(args) == 0 {
		topUsage(stderr)
		return exitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		if len(args) > 1 && args[0] == "help" {
			// "idemq help processed show" is "idemq processed show --help".
			return runEnv(ctx, append(args[1:len(args):len(args)], "--help"), e)
		}
		topUsage(stdout)
		return exitOK
	}

	cmd, rest := findCommand(args)
	if cmd == nil {
		prefix := leadingWords(args)
		if group := commandsUnder(prefix); len(group) > 0 {
			// A group such as "processed" without its subcommand.
			w := stderr
			code := exitUsage
			if len(args) > len(strings.Fields(prefix)) && isHelp(args[len(strings.Fields(prefix))]) {
				w, code = stdout, exitOK
			} else if len(args) > len(strings.Fields(prefix)) {
				fmt.Fprintf(stderr, "idemq: unknown command %q\n\n", prefix+" "+args[len(strings.Fields(prefix))])
			}
			groupUsage(w, prefix, group)
			return code
		}
		fmt.Fprintf(stderr, "idemq: unknown command %q\nRun 'idemq --help' for the list of commands.\n", args[0])
		return exitUsage
	}

	err := cmd.run(ctx, e, cmd, rest)
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	}
	var xe *exitError
	if errors.As(err, &xe) {
		fmt.Fprintf(stderr, "idemq %s: %v\n", cmd.name, err)
		return xe.code
	}
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(stderr, "idemq %s: %v\nRun 'idemq %s --help' for usage.\n", cmd.name, err, cmd.name)
		return exitUsage
	}
	fmt.Fprintf(stderr, "idemq %s: %v\n", cmd.name, err)
	if ctx.Err() != nil {
		fmt.Fprintln(stderr, "idemq: interrupted")
	}
	return exitFail
}

func isHelp(s string) bool {
	switch s {
	case "-h", "-help", "--help", "help":
		return true
	}
	return false
}

// leadingWords returns the arguments before the first flag, joined by
// spaces, up to the first word that starts no command.
func leadingWords(args []string) string {
	var words []string
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			break
		}
		cand := strings.Join(append(words[:len(words):len(words)], a), " ")
		if len(commandsUnder(cand)) == 0 {
			break
		}
		words = append(words, a)
	}
	return strings.Join(words, " ")
}

func topUsage(w io.Writer) {
	fmt.Fprint(w, `idemq administers the Postgres tables of idemq, the idempotent queue consumer.

Usage:
  idemq <command> [flags] [args]

Commands:
`)
	printCommandList(w, commands)
	fmt.Fprint(w, `
The database is taken from --database-url, then $DATABASE_URL, then
`+defaultDatabaseURL+`.

Run 'idemq <command> --help' for a command's flags.
Exit status: 0 success, 1 failure (including "not found"), 2 usage error.
`)
}

func groupUsage(w io.Writer, prefix string, group []*command) {
	fmt.Fprintf(w, "Usage:\n  idemq %s <command> [flags] [args]\n\nCommands:\n", prefix)
	printCommandList(w, group)
	fmt.Fprintf(w, "\nRun 'idemq %s <command> --help' for a command's flags.\n", prefix)
}

func printCommandList(w io.Writer, cmds []*command) {
	width := 0
	for _, c := range cmds {
		width = max(width, len(c.synopsis()))
	}
	for _, c := range cmds {
		fmt.Fprintf(w, "  %-*s  %s\n", width, c.synopsis(), c.summary)
	}
}
