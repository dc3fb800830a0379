package readmetour

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// tourDocs are the documents the tour reads, in the order it runs their
// commands: the README, then the guides, each after those whose commands
// leave what its own need (the quickstart's schema, payments.dlq).
var tourDocs = []string{
	"README.md",
	"docs/handlers.md",
	"docs/configuration.md",
	"docs/dedup-store.md",
	"docs/brokers.md",
	"docs/batch-mode.md",
	"docs/bench-ceiling.md",
	"docs/bench-history.md",
	"docs/dead-letters.md",
	"docs/outbox-keys-http.md",
	"docs/reconcile.md",
	"docs/observability.md",
	"docs/clusters.md",
	"docs/sharding.md",
	"docs/operations.md",
	"docs/security.md",
	"docs/testing.md",
	"docs/chaos.md",
}

// block is one fenced code block of a document.
type block struct {
	file string // the document, relative to the repository root
	lang string // the info string: "sh", "go", "" ...
	line int    // 1-based line of the opening fence
	// skip is the reason given by a "<!-- tour: skip (reason) -->" comment
	// on the line before the fence, or "".
	skip  string
	lines []string
}

var skipComment = regexp.MustCompile(`^<!--\s*tour:\s*skip\s*\((.+)\)\s*-->\s*$`)

// repoRoot is the module root, two levels up from this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("no go.mod at %s: %v", root, err)
	}
	return root
}

// where is "file:line" of the block's opening fence.
func (b block) where() string { return fmt.Sprintf("%s:%d", b.file, b.line) }

// docBlocks returns the fenced code blocks of every document of tourDocs,
// in order, and fails if a Markdown file of docs/ is not among them.
func docBlocks(t *testing.T, root string) []block {
	t.Helper()
	guides, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range guides {
		rel, _ := filepath.Rel(root, g)
		found := false
		for _, d := range tourDocs {
			found = found || d == filepath.ToSlash(rel)
		}
		if !found {
			t.Fatalf("%s is not in readmetour's tourDocs: add it where its commands belong in the tour", rel)
		}
	}
	var out []block
	for _, d := range tourDocs {
		out = append(out, readmeBlocks(t, root, d)...)
	}
	return out
}

// readmeBlocks parses the fenced code blocks of the document name, a path
// relative to root.
func readmeBlocks(t *testing.T, root, name string) []block {
	t.Helper()
	f, err := os.Open(filepath.Join(root, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var (
		blocks []block
		cur    *block
		prev   string // the previous line outside a block
	)
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if cur == nil {
			if strings.HasPrefix(line, "```") {
				b := block{file: name, lang: strings.TrimSpace(strings.TrimPrefix(line, "```")), line: n}
				if m := skipComment.FindStringSubmatch(strings.TrimSpace(prev)); m != nil {
					b.skip = m[1]
				}
				cur = &b
				continue
			}
			if strings.HasPrefix(strings.TrimSpace(line), "<!--") && !skipComment.MatchString(strings.TrimSpace(line)) &&
				strings.Contains(line, "tour:") {
				t.Fatalf("%s:%d: malformed tour comment %q; want <!-- tour: skip (reason) -->", name, n, line)
			}
			prev = line
			continue
		}
		if strings.HasPrefix(line, "```") {
			blocks = append(blocks, *cur)
			cur, prev = nil, ""
			continue
		}
		cur.lines = append(cur.lines, line)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur != nil {
		t.Fatalf("%s: unterminated code block", cur.where())
	}
	return blocks
}

// command is one shell command of an sh block.
type command struct {
	text  string
	where string // file:line of its first line
}

// shellCommands splits an sh block into commands: one per line, with
// backslash-continued lines joined; blank lines and comment lines are
// dropped. A line that starts with a "$ " prompt is an error: sample output
// goes in a block of its own, without a language.
func shellCommands(t *testing.T, b block) []command {
	t.Helper()
	var cmds []command
	var cur []string
	start := 0
	for i, l := range b.lines {
		n := b.line + 1 + i
		trimmed := strings.TrimSpace(l)
		if len(cur) == 0 {
			if trimmed == "" || strings.HasPrefix(trimmed, "#") {
				continue
			}
			if strings.HasPrefix(trimmed, "$ ") {
				t.Fatalf("%s:%d: %q in an sh block: put the command without its prompt in the sh block and its output in a block without a language", b.file, n, l)
			}
			start = n
		}
		if strings.HasSuffix(l, `\`) {
			cur = append(cur, strings.TrimSuffix(l, `\`))
			continue
		}
		cur = append(cur, l)
		cmds = append(cmds, command{text: strings.TrimSpace(strings.Join(cur, " ")), where: fmt.Sprintf("%s:%d", b.file, start)})
		cur = nil
	}
	if len(cur) > 0 {
		t.Fatalf("%s:%d: sh block ends in a continued line", b.file, start)
	}
	return cmds
}
