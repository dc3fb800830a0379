// Package apisurface counts the exported top-level names of idemq's public
// packages, so that the API's size is a decision, not an accident: its
// test fails when a package's count grows past its budget.
package apisurface

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Public lists the public packages, as directories relative to the module
// root: every package outside internal/, cmd/, examples/ and
// integration/.
func Public(root string) ([]string, error) {
	var dirs []string
	skip := map[string]bool{"internal": true, "cmd": true, "examples": true, "integration": true, "testdata": true}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(root, path)
		if rel != "." && (skip[filepath.ToSlash(rel)] || skip[d.Name()] || strings.HasPrefix(d.Name(), ".")) {
			return filepath.SkipDir
		}
		if names, err := filepath.Glob(filepath.Join(path, "*.go")); err == nil {
			for _, n := range names {
				if !strings.HasSuffix(n, "_test.go") {
					dirs = append(dirs, filepath.ToSlash(rel))
					break
				}
			}
		}
		return nil
	})
	sort.Strings(dirs)
	return dirs, err
}

// goFile is one parsed non-test file of a package.
type goFile struct {
	name string // the file's base name
	f    *ast.File
}

// parseDir parses the non-test Go files of the package in dir, with
// comments if mode asks for them, into one file set.
func parseDir(dir string, mode parser.Mode) (*token.FileSet, []goFile, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, err
	}
	fset := token.NewFileSet()
	var files []goFile
	for _, e := range entries {
		n := e.Name()
		if e.IsDir() || !strings.HasSuffix(n, ".go") || strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, n), nil, mode|parser.SkipObjectResolution)
		if err != nil {
			return nil, nil, fmt.Errorf("apisurface: %w", err)
		}
		files = append(files, goFile{name: n, f: f})
	}
	return fset, files, nil
}

// Exported returns the exported top-level names (functions, types,
// variables and constants; not methods or fields) of the package in dir,
// from its non-test files, sorted.
func Exported(dir string) ([]string, error) {
	_, files, err := parseDir(dir, 0)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, gf := range files {
		for _, decl := range gf.f.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil && d.Name.IsExported() {
					names = append(names, d.Name.Name)
				}
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					switch s := spec.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							names = append(names, s.Name.Name)
						}
					case *ast.ValueSpec:
						for _, id := range s.Names {
							if id.IsExported() {
								names = append(names, id.Name)
							}
						}
					}
				}
			}
		}
	}
	sort.Strings(names)
	return names, nil
}
