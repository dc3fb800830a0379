package readmetour

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// block is one fenced code block of README.md.
type block struct {
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

// readmeBlocks parses the fenced code blocks of the README at path.
func readmeBlocks(t *testing.T, path string) []block {
	t.Helper()
	f, err := os.Open(path)
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
				b := block{lang: strings.TrimSpace(strings.TrimPrefix(line, "```")), line: n}
				if m := skipComment.FindStringSubmatch(strings.TrimSpace(prev)); m != nil {
					b.skip = m[1]
				}
				cur = &b
				continue
			}
			if strings.HasPrefix(strings.TrimSpace(line), "<!--") && !skipComment.MatchString(strings.TrimSpace(line)) &&
				strings.Contains(line, "tour:") {
				t.Fatalf("README.md:%d: malformed tour comment %q; want <!-- tour: skip (reason) -->", n, line)
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
		t.Fatalf("README.md:%d: unterminated code block", cur.line)
	}
	return blocks
}

// command is one shell command of an sh block.
type command struct {
	text string
	line int // README line of its first line
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
				t.Fatalf("README.md:%d: %q in an sh block: put the command without its prompt in the sh block and its output in a block without a language", n, l)
			}
			start = n
		}
		if strings.HasSuffix(l, `\`) {
			cur = append(cur, strings.TrimSuffix(l, `\`))
			continue
		}
		cur = append(cur, l)
		cmds = append(cmds, command{text: strings.TrimSpace(strings.Join(cur, " ")), line: start})
		cur = nil
	}
	if len(cur) > 0 {
		t.Fatalf("README.md:%d: sh block ends in a continued line", start)
	}
	return cmds
}
