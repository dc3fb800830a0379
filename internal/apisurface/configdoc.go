package apisurface

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// ConfigTables renders, for every exported struct type of the public
// packages under root whose name ends in Config or Options, a Markdown
// table of its exported fields: the field, its default (the sentence of
// its doc comment that starts "Defaults to", or "Default"), and what it
// does (the doc comment's first sentence). The doc comments are the one
// place each fact is said; docs/configuration.md holds this rendering.
func ConfigTables(root string) (string, error) {
	dirs, err := Public(root)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, dir := range dirs {
		if strings.HasSuffix(dir, "test") { // brokertest, idemqtest: test kits
			continue
		}
		types, err := configTypes(filepath.Join(root, dir))
		if err != nil {
			return "", err
		}
		for _, t := range types {
			fmt.Fprintf(&b, "### %s.%s\n\n", path.Base(dir), t.name)
			if t.doc != "" {
				fmt.Fprintf(&b, "%s\n\n", firstSentence(t.doc))
			}
			b.WriteString("| field | default | what it does |\n| --- | --- | --- |\n")
			for _, f := range t.fields {
				fmt.Fprintf(&b, "| `%s` | %s | %s |\n", f.name, cell(defaultOf(f.doc)), cell(firstSentence(f.doc)))
			}
			b.WriteString("\n")
		}
	}
	return b.String(), nil
}

type configType struct {
	name, doc string
	fields    []configField
}

type configField struct{ name, doc string }

// configTypes returns the Config and Options structs of the package in
// dir, sorted by name, each with its exported fields in source order.
func configTypes(dir string) ([]configType, error) {
	_, files, err := parseDir(dir, parser.ParseComments)
	if err != nil {
		return nil, err
	}
	var out []configType
	for _, gf := range files {
		for _, decl := range gf.f.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.TYPE {
				continue
			}
			for _, spec := range gd.Specs {
				ts := spec.(*ast.TypeSpec)
				st, ok := ts.Type.(*ast.StructType)
				name := ts.Name.Name
				if !ok || !ts.Name.IsExported() || !(strings.HasSuffix(name, "Config") || strings.HasSuffix(name, "Options")) {
					continue
				}
				doc := ts.Doc
				if doc == nil {
					doc = gd.Doc
				}
				ct := configType{name: name, doc: doc.Text()}
				for _, fl := range st.Fields.List {
					for _, id := range fl.Names {
						if id.IsExported() {
							ct.fields = append(ct.fields, configField{name: id.Name, doc: fl.Doc.Text()})
						}
					}
				}
				out = append(out, ct)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out, nil
}

// sentences splits a doc comment into sentences, its lines joined.
func sentences(doc string) []string {
	text := strings.Join(strings.Fields(doc), " ")
	var out []string
	for text != "" {
		i := sentenceEnd(text)
		out = append(out, strings.TrimSpace(text[:i]))
		text = strings.TrimSpace(text[i:])
	}
	return out
}

// sentenceEnd returns the index just past the first sentence of text: a
// period, colon-free, followed by a space and a capital letter or the end.
func sentenceEnd(text string) int {
	depth := 0
	for i := 0; i < len(text); i++ {
		switch text[i] {
		case '(':
			depth++
		case ')':
			depth--
		case '.':
			if depth > 0 {
				continue
			}
			if i+1 == len(text) {
				return i + 1
			}
			if text[i+1] == ' ' && i+2 < len(text) && (text[i+2] >= 'A' && text[i+2] <= 'Z' || text[i+2] == '[' || text[i+2] == '`' || text[i+2] == '-') {
				return i + 1
			}
		}
	}
	return len(text)
}

func firstSentence(doc string) string {
	if s := sentences(doc); len(s) > 0 {
		return s[0]
	}
	return ""
}

// defaultOf returns the sentences of doc that state a default.
func defaultOf(doc string) string {
	var out []string
	for _, s := range sentences(doc) {
		if strings.HasPrefix(s, "Defaults to") || strings.HasPrefix(s, "Default") || strings.Contains(s, " defaults to ") {
			out = append(out, s)
		}
	}
	if len(out) == 0 {
		return "—"
	}
	return strings.Join(out, " ")
}

// cell escapes s for a Markdown table cell.
func cell(s string) string {
	return strings.ReplaceAll(s, "|", `\|`)
}
