package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
)

// command is one entry of the command table.
type command struct {
	// name is the command's words, such as "processed show".
	name string
	// args is the synopsis of its positional arguments, such as
	// "<consumer> <id>".
	args string
	// summary is a one-line description for the command list.
	summary string
	// help is the longer description printed by --help.
	help string
	// run parses args (the words after the name) and runs the command.
	// It returns nil, flag.ErrHelp after printing help, a *usageError, or
	// another error.
	run func(ctx context.Context, e *env, c *command, args []string) error
}

// commands is the command table, in the order --help lists it. To add a
// command, write its run function in a new file and add a line here.
var commands = []*command{
	migrateCommand,
	processedShowCommand,
	processedPurgeCommand,
	processedMoveCommand,
	dlqInspectCommand,
	dlqReplayCommand,
	benchCommand,
	chaosCommand,
	statusCommand,
	reconcileCommand,
}

func (c *command) synopsis() string {
	if c.args == "" {
		return c.name
	}
	return c.name + " " + c.args
}

// findCommand returns the command whose name is the longest prefix of args,
// and the arguments after it.
func findCommand(args []string) (*command, []string) {
	var best *command
	bestLen := 0
	for _, c := range commands {
		words := strings.Fields(c.name)
		if len(words) <= bestLen || len(words) > len(args) {
			continue
		}
		match := true
		for i, w := range words {
			if args[i] != w {
				match = false
				break
			}
		}
		if match {
			best, bestLen = c, len(words)
		}
	}
	if best == nil {
		return nil, nil
	}
	return best, args[bestLen:]
}

// commandsUnder returns the commands whose name starts with the words of
// prefix.
func commandsUnder(prefix string) []*command {
	if prefix == "" {
		return nil
	}
	var out []*command
	for _, c := range commands {
		if c.name == prefix || strings.HasPrefix(c.name, prefix+" ") {
			out = append(out, c)
		}
	}
	return out
}

// flagSet returns an empty flag set for c whose errors the caller reports.
func (c *command) flagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("idemq "+c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// parse parses flags and positional arguments in any order (a "--" ends
// the flags) and checks the number of positional arguments. On -h it prints
// the command's help to stdout and returns flag.ErrHelp.
func (c *command) parse(e *env, fs *flag.FlagSet, args []string, nargs int) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if err == flag.ErrHelp {
				c.printHelp(e.stdout, fs)
				return nil, flag.ErrHelp
			}
			return nil, &usageError{msg: err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		// Parse stops at the first positional argument, or drops a "--"
		// and stops after it: then everything left is positional.
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			pos = append(pos, rest...)
			break
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
	if len(pos) != nargs {
		if nargs == 0 {
			return nil, usagef("unexpected argument %q", pos[0])
		}
		return nil, usagef("want %d arguments (%s), got %d", nargs, c.args, len(pos))
	}
	return pos, nil
}

func (c *command) printHelp(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage:\n  idemq %s [flags]\n\n%s\n", c.synopsis(), strings.TrimSpace(c.help))
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	if n > 0 {
		fmt.Fprint(w, "\nFlags:\n")
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
}
