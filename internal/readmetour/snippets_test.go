package readmetour

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// snippetImports maps the package names README snippets use to their
// import paths. A snippet gets the imports of the names it selects from.
var snippetImports = map[string]string{
	"context":     "context",
	"json":        "encoding/json",
	"errors":      "errors",
	"fmt":         "fmt",
	"http":        "net/http",
	"os":          "os",
	"slog":        "log/slog",
	"time":        "time",
	"testing":     "testing",
	"pgx":         "github.com/jackc/pgx/v5",
	"pgxpool":     "github.com/jackc/pgx/v5/pgxpool",
	"amqp":        "github.com/rabbitmq/amqp091-go",
	"prometheus":  "github.com/prometheus/client_golang/prometheus",
	"consumer":    "github.com/idemq/idemq/consumer",
	"processed":   "github.com/idemq/idemq/processed",
	"memory":      "github.com/idemq/idemq/brokers/memory",
	"rabbitmq":    "github.com/idemq/idemq/brokers/rabbitmq",
	"kafka":       "github.com/idemq/idemq/brokers/kafka",
	"franz":       "github.com/idemq/idemq/brokers/franz",
	"dlq":         "github.com/idemq/idemq/dlq",
	"outbox":      "github.com/idemq/idemq/outbox",
	"keys":        "github.com/idemq/idemq/keys",
	"httpidem":    "github.com/idemq/idemq/httpidem",
	"idemqprom":   "github.com/idemq/idemq/observability/prometheus",
	"idemqotel":   "github.com/idemq/idemq/observability/otel",
	"idemqtest":   "github.com/idemq/idemq/idemqtest",
	"natsjs":      "github.com/idemq/idemq/brokers/nats",
	"redisstream": "github.com/idemq/idemq/brokers/redisstream",
}

// snippetWorld declares what README snippets use without declaring: the
// variables and helpers a reader has in scope (ctx, pool, tx, msg, a
// broker, a Source of each kind...). Snippets that declare one of these
// names shadow it. A snippet that needs more gives it in an HTML comment
// on the line before its block: <!-- snippet: Go declarations -->.
const snippetWorld = `package main

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/outbox"
)

var (
	ctx             = context.Background()
	pool            *pgxpool.Pool
	tx              pgx.Tx
	msg             = &consumer.Message{}
	broker          = memory.NewBroker()
	rabbitSrc       *rabbitmq.Source
	kafkaSrc        *kafka.Source
	rabbitPublisher *rabbitmq.Publisher
	publish         func(context.Context, *consumer.Message) error
	b               dlq.Browser
	cfg             consumer.Config
	ob              *outbox.Outbox
	body            []byte
	orderID         string
	paymentsHandler http.Handler
)

func insertLedgerRows(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error { return nil }

func tenantOf(r *http.Request) string { return r.Host }

func main() {}
`

var snippetComment = regexp.MustCompile(`^<!--\s*snippet:\s*(.*?)\s*-->\s*$`)

// snippetFile turns README snippet n into a Go file of package main: a
// snippet of declarations as it is, a snippet of statements as the body of
// a function returning error. Every variable a statement declares is
// marked used (_ = v) right after it, and the file imports the packages
// the snippet selects from.
func snippetFile(t *testing.T, n int, b block) string {
	t.Helper()
	src := strings.Join(b.lines, "\n") + "\n"
	fset := token.NewFileSet()
	// Declarations?
	if f, err := parser.ParseFile(fset, "", "package main\n"+src, parser.SkipObjectResolution); err == nil {
		return withImports(f, "package main\n", src)
	}
	head := fmt.Sprintf("package main\n\n// snippet %d: %s\nfunc snippet%d() error {\n", n, b.where(), n)
	whole := head + src + "}\n"
	f, err := parser.ParseFile(fset, "", whole, parser.SkipObjectResolution)
	if err != nil {
		t.Errorf("%s: go snippet %d does not parse, as declarations or as statements: %v\n%s", b.where(), n, err, src)
		return ""
	}
	// Mark declared variables used, inserting from the end.
	type ins struct {
		off  int
		text string
	}
	var inserts []ins
	var lastIsReturn bool
	ast.Inspect(f, func(node ast.Node) bool {
		blk, ok := node.(*ast.BlockStmt)
		if !ok {
			return true
		}
		for _, st := range blk.List {
			var names []string
			switch s := st.(type) {
			case *ast.AssignStmt:
				if s.Tok == token.DEFINE {
					for _, l := range s.Lhs {
						if id, ok := l.(*ast.Ident); ok && id.Name != "_" {
							names = append(names, id.Name)
						}
					}
				}
			case *ast.DeclStmt:
				if gd, ok := s.Decl.(*ast.GenDecl); ok && gd.Tok == token.VAR {
					for _, sp := range gd.Specs {
						for _, id := range sp.(*ast.ValueSpec).Names {
							if id.Name != "_" {
								names = append(names, id.Name)
							}
						}
					}
				}
			}
			if len(names) > 0 {
				blanks := strings.TrimSuffix(strings.Repeat("_, ", len(names)), ", ")
				inserts = append(inserts, ins{fset.Position(st.End()).Offset, "; " + blanks + " = " + strings.Join(names, ", ")})
			}
		}
		return true
	})
	if fn, ok := f.Decls[len(f.Decls)-1].(*ast.FuncDecl); ok && len(fn.Body.List) > 0 {
		_, lastIsReturn = fn.Body.List[len(fn.Body.List)-1].(*ast.ReturnStmt)
	}
	sort.Slice(inserts, func(i, j int) bool { return inserts[i].off > inserts[j].off })
	for _, in := range inserts {
		whole = whole[:in.off] + in.text + whole[in.off:]
	}
	if !lastIsReturn {
		whole = strings.TrimSuffix(whole, "}\n") + "return nil\n}\n"
	}
	return withImports(f, head, strings.TrimPrefix(whole, head))
}

// withImports returns head, the imports of the packages f selects from, and
// rest.
func withImports(f *ast.File, head, rest string) string {
	used := map[string]bool{}
	ast.Inspect(f, func(node ast.Node) bool {
		if sel, ok := node.(*ast.SelectorExpr); ok {
			if id, ok := sel.X.(*ast.Ident); ok {
				if _, known := snippetImports[id.Name]; known {
					used[id.Name] = true
				}
			}
		}
		return true
	})
	var imports []string
	for name := range used {
		imports = append(imports, fmt.Sprintf("\t%s %q\n", name, snippetImports[name]))
	}
	sort.Strings(imports)
	pkgLine, body, _ := strings.Cut(head, "\n")
	imp := ""
	if len(imports) > 0 {
		imp = "\nimport (\n" + strings.Join(imports, "") + ")\n"
	}
	return pkgLine + "\n" + imp + body + rest
}

// TestReadmeSnippetsCompile compiles every go block of README.md, with the
// declarations of snippetWorld, in a module of its own that uses this
// repository through a replace directive, and vets it.
func TestReadmeSnippetsCompile(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module: not in -short")
	}
	root := repoRoot(t)
	blocks := docBlocks(t, root)
	dir := t.TempDir()
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	mod := regexp.MustCompile(`(?m)^module .*$`).ReplaceAllString(string(gomod), "module readmesnippets")
	mod += "\nrequire github.com/idemq/idemq v0.0.0\n\nreplace github.com/idemq/idemq => " + root + "\n"
	write := func(name, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", mod)
	if sum, err := os.ReadFile(filepath.Join(root, "go.sum")); err == nil {
		write("go.sum", string(sum))
	}
	world := snippetWorld
	n := 0
	files := map[string]string{} // file name -> the block's file:line
	for _, b := range blocks {
		if b.lang != "go" {
			continue
		}
		n++
		src := snippetFile(t, n, b)
		if src == "" {
			continue
		}
		name := fmt.Sprintf("snippet%02d.go", n)
		files[name] = b.where()
		write(name, src)
	}
	// Per-snippet declarations from <!-- snippet: ... --> comments.
	for _, doc := range tourDocs {
		for _, extra := range snippetExtras(t, filepath.Join(root, doc)) {
			world += "\n" + extra + "\n"
		}
	}
	write("world.go", world)
	if n == 0 {
		t.Fatal("README.md and docs/ have no go snippets")
	}
	t.Logf("%d go snippets", n)
	if t.Failed() {
		return
	}
	for _, args := range [][]string{{"build", "-o", os.DevNull, "."}, {"vet", "."}} {
		cmd := exec.Command("go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod", "GOPROXY=off")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go %s of the go snippets of README.md and docs/ failed: %v\n%s\n(snippetNN.go is the NNth go block: %v)\n%s",
				args[0], err, annotate(out, files), files, dump(dir, out))
		}
	}
}

// snippetExtras returns the declarations of the README's <!-- snippet: ...
// --> comments.
func snippetExtras(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		if m := snippetComment.FindStringSubmatch(strings.TrimSpace(l)); m != nil {
			out = append(out, m[1])
		}
	}
	return out
}

// annotate appends the README line to each "./snippetNN.go:" in out.
func annotate(out []byte, files map[string]string) string {
	s := string(out)
	for name, where := range files {
		s = strings.ReplaceAll(s, "./"+name+":", fmt.Sprintf("./%s (the go block at %s):", name, where))
	}
	return s
}

// dump returns the generated files named in out, for the failure message.
func dump(dir string, out []byte) string {
	var buf bytes.Buffer
	for _, m := range regexp.MustCompile(`snippet\d+\.go`).FindAllString(string(out), -1) {
		if strings.Contains(buf.String(), "== "+m) {
			continue
		}
		data, _ := os.ReadFile(filepath.Join(dir, m))
		fmt.Fprintf(&buf, "== %s\n%s\n", m, data)
	}
	return buf.String()
}
