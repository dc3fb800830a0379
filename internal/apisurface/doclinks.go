package apisurface

import (
	"fmt"
	"go/ast"
	"go/parser"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// pkgNames is what doc links can name in one package: its top-level
// names, and each type's methods and fields.
type pkgNames struct {
	top     map[string]bool
	members map[string]map[string]bool // type -> method or field names
	imports map[string]string          // import name -> import path, per file merged
}

// docLink matches a doc link: [Name], [Name.Member], [pkg.Name] or
// [pkg.Name.Member], with an optional * before the name, not followed by
// "(" or ":" (a Markdown link or a link definition).
var docLink = regexp.MustCompile(`\[\*?([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){0,2})\]([^(:]|$)`)

// BrokenDocLinks returns the doc links of the public packages under root,
// in module module, that name nothing: "file:line: [link]". Links into
// packages outside the module are not checked.
func BrokenDocLinks(root, module string) ([]string, error) {
	dirs, err := Public(root)
	if err != nil {
		return nil, err
	}
	cache := map[string]*pkgNames{}
	load := func(dir string) (*pkgNames, error) {
		if p, ok := cache[dir]; ok {
			return p, nil
		}
		p, err := readNames(filepath.Join(root, dir))
		cache[dir] = p
		return p, err
	}
	var broken []string
	for _, dir := range dirs {
		own, err := load(dir)
		if err != nil {
			return nil, err
		}
		fset, files, err := parseDir(filepath.Join(root, dir), parser.ParseComments)
		if err != nil {
			return nil, err
		}
		for _, gf := range files {
			f, n := gf.f, gf.name
			imports := fileImports(f)
			for _, cg := range f.Comments {
				for _, m := range docLink.FindAllStringSubmatch(cg.Text(), -1) {
					parts := strings.Split(m[1], ".")
					ok, checked := resolve(parts, own, imports, module, func(importPath string) (*pkgNames, error) {
						return load(strings.TrimPrefix(strings.TrimPrefix(importPath, module), "/"))
					})
					if checked && !ok {
						broken = append(broken, fmt.Sprintf("%s:%d: [%s]", path.Join(dir, n), fset.Position(cg.Pos()).Line, m[1]))
					}
				}
			}
		}
	}
	return broken, nil
}

// resolve reports whether parts name something, and whether it could be
// checked at all (a lower-case word that is no import is plain text).
func resolve(parts []string, own *pkgNames, imports map[string]string, module string, load func(string) (*pkgNames, error)) (ok, checked bool) {
	inPkg := func(p *pkgNames, parts []string) bool {
		switch len(parts) {
		case 1:
			return p.top[parts[0]]
		case 2:
			return p.members[parts[0]][parts[1]]
		}
		return false
	}
	if ip, isImport := imports[parts[0]]; isImport && len(parts) > 1 {
		if ip != module && !strings.HasPrefix(ip, module+"/") {
			return true, false
		}
		p, err := load(ip)
		if err != nil {
			return false, true
		}
		return inPkg(p, parts[1:]), true
	}
	if !ast.IsExported(parts[0]) {
		return true, false
	}
	return inPkg(own, parts), true
}

func fileImports(f *ast.File) map[string]string {
	m := map[string]string{}
	for _, is := range f.Imports {
		p, _ := strconv.Unquote(is.Path.Value)
		name := path.Base(p)
		if strings.HasPrefix(name, "v") && len(name) > 1 && name[1] >= '0' && name[1] <= '9' {
			name = path.Base(path.Dir(p)) // .../pgx/v5
		}
		if is.Name != nil {
			name = is.Name.Name
		}
		m[name] = p
	}
	return m
}

func readNames(dir string) (*pkgNames, error) {
	p := &pkgNames{top: map[string]bool{}, members: map[string]map[string]bool{}}
	_, files, err := parseDir(dir, 0)
	if err != nil {
		return p, err
	}
	member := func(typ, name string) {
		if p.members[typ] == nil {
			p.members[typ] = map[string]bool{}
		}
		p.members[typ][name] = true
	}
	for _, gf := range files {
		for _, decl := range gf.f.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil {
					p.top[d.Name.Name] = true
					continue
				}
				t := d.Recv.List[0].Type
				if s, ok := t.(*ast.StarExpr); ok {
					t = s.X
				}
				if ix, ok := t.(*ast.IndexExpr); ok {
					t = ix.X
				}
				if id, ok := t.(*ast.Ident); ok {
					member(id.Name, d.Name.Name)
				}
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					switch s := spec.(type) {
					case *ast.TypeSpec:
						p.top[s.Name.Name] = true
						var fields *ast.FieldList
						switch t := s.Type.(type) {
						case *ast.StructType:
							fields = t.Fields
						case *ast.InterfaceType:
							fields = t.Methods
						}
						if fields != nil {
							for _, fl := range fields.List {
								for _, id := range fl.Names {
									member(s.Name.Name, id.Name)
								}
								if len(fl.Names) == 0 { // embedded
									t := fl.Type
									if st, ok := t.(*ast.StarExpr); ok {
										t = st.X
									}
									switch et := t.(type) {
									case *ast.Ident:
										member(s.Name.Name, et.Name)
									case *ast.SelectorExpr:
										member(s.Name.Name, et.Sel.Name)
									}
								}
							}
						}
					case *ast.ValueSpec:
						for _, id := range s.Names {
							p.top[id.Name] = true
						}
					}
				}
			}
		}
	}
	return p, nil
}
