package apisurface

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var (
	mdLink    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	mdHeading = regexp.MustCompile(`(?m)^#+\s+(.+)$`)
	notSlug   = regexp.MustCompile(`[^\p{L}\p{N}_\- ]`)
)

// TestMarkdownLinksResolve: every relative link of every Markdown file in
// the repository names a file that exists, relative to the linking file as
// a repository host renders it, and every #anchor into a Markdown file
// names one of its headings.
func TestMarkdownLinksResolve(t *testing.T) {
	root := "../.."
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && p != root {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, ".md") {
			return nil
		}
		text, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range mdLink.FindAllStringSubmatch(string(text), -1) {
			link := m[1]
			if strings.Contains(link, "://") || strings.HasPrefix(link, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(link, "#")
			target := p
			if file != "" {
				target = filepath.Join(filepath.Dir(p), file)
			}
			rel, _ := filepath.Rel(root, p)
			if _, err := os.Stat(target); err != nil {
				t.Errorf("%s: link %s: no such file", rel, link)
				continue
			}
			if anchor != "" && strings.HasSuffix(target, ".md") && !hasAnchor(t, target, anchor) {
				t.Errorf("%s: link %s: no such heading", rel, link)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// hasAnchor reports whether the Markdown file has a heading whose slug, as
// a repository host makes it, is anchor.
func hasAnchor(t *testing.T, file, anchor string) bool {
	text, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range mdHeading.FindAllStringSubmatch(string(text), -1) {
		slug := strings.ReplaceAll(notSlug.ReplaceAllString(strings.ToLower(strings.TrimSpace(h[1])), ""), " ", "-")
		if slug == anchor {
			return true
		}
	}
	return false
}
