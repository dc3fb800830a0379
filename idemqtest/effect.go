package idemqtest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
)

// normalize turns an effect into plain JSON data (maps, slices, strings,
// json.Number, bools, nil), so that effects compare as data.
func normalize(v any) (any, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("idemqtest: the effect cannot be encoded as JSON: %w", err)
	}
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var out any
	if err := d.Decode(&out); err != nil {
		return nil, err
	}
	return out, nil
}

// render is v as indented JSON, map keys sorted.
func render(v any) string {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Sprintf("%#v", v)
	}
	return string(b)
}

// dropKeys removes the keys in ignore from every object in v, at any depth.
func dropKeys(v any, ignore []string) any {
	if len(ignore) == 0 {
		return v
	}
	switch x := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			if !slices.Contains(ignore, k) {
				out[k] = dropKeys(e, ignore)
			}
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = dropKeys(e, ignore)
		}
		return out
	}
	return v
}

// volatileMark replaces values that differed between two clean runs.
const volatileMark = "<differs between two clean runs: see the determinism case>"

// volatile returns the paths at which a and b differ.
func volatile(a, b any) map[string]bool {
	out := map[string]bool{}
	var walk func(path string, a, b any)
	walk = func(path string, a, b any) {
		am, aok := a.(map[string]any)
		bm, bok := b.(map[string]any)
		if aok && bok {
			for k, av := range am {
				if bv, ok := bm[k]; ok {
					walk(path+"."+k, av, bv)
				}
			}
			return
		}
		as, aok := a.([]any)
		bs, bok := b.([]any)
		if aok && bok && len(as) == len(bs) {
			for i := range as {
				walk(path+"["+strconv.Itoa(i)+"]", as[i], bs[i])
			}
			return
		}
		if !reflect.DeepEqual(a, b) {
			out[path] = true
		}
	}
	walk("", a, b)
	return out
}

// mask replaces the values at paths with volatileMark.
func mask(v any, paths map[string]bool) any {
	if len(paths) == 0 {
		return v
	}
	var walk func(path string, v any) any
	walk = func(path string, v any) any {
		if paths[path] {
			return volatileMark
		}
		switch x := v.(type) {
		case map[string]any:
			out := make(map[string]any, len(x))
			for k, e := range x {
				out[k] = walk(path+"."+k, e)
			}
			return out
		case []any:
			out := make([]any, len(x))
			for i, e := range x {
				out[i] = walk(path+"["+strconv.Itoa(i)+"]", e)
			}
			return out
		}
		return v
	}
	return walk("", v)
}

// wantOnce labels the reference of most cases.
const wantOnce = "want (each sample applied once)"

// diff is a line diff of want and got, rendered as JSON, under the labels:
// unchanged lines start with two spaces, lines only in want with "- ",
// lines only in got with "+ ". Long runs of unchanged lines are elided.
func diff(wantLabel, gotLabel string, want, got any) string {
	a := strings.Split(render(want), "\n")
	b := strings.Split(render(got), "\n")
	// LCS table; effects are small.
	n, m := len(a), len(b)
	lcs := make([][]int, n+1)
	for i := range lcs {
		lcs[i] = make([]int, m+1)
	}
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			if a[i] == b[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	type line struct {
		op   byte
		text string
	}
	var lines []line
	i, j := 0, 0
	for i < n || j < m {
		switch {
		case i < n && j < m && a[i] == b[j]:
			lines = append(lines, line{' ', a[i]})
			i++
			j++
		case i < n && (j == m || lcs[i+1][j] >= lcs[i][j+1]):
			lines = append(lines, line{'-', a[i]})
			i++
		default:
			lines = append(lines, line{'+', b[j]})
			j++
		}
	}
	const ctx = 3
	var sb strings.Builder
	sb.WriteString("--- " + wantLabel + "\n+++ " + gotLabel + "\n")
	skipped := 0
	for k, l := range lines {
		near := false
		for d := max(0, k-ctx); d <= min(len(lines)-1, k+ctx); d++ {
			if lines[d].op != ' ' {
				near = true
				break
			}
		}
		if !near {
			skipped++
			continue
		}
		if skipped > 0 {
			fmt.Fprintf(&sb, "  ... (%d unchanged lines)\n", skipped)
			skipped = 0
		}
		sb.WriteByte(l.op)
		sb.WriteByte(' ')
		sb.WriteString(l.text)
		sb.WriteByte('\n')
	}
	if skipped > 0 {
		fmt.Fprintf(&sb, "  ... (%d unchanged lines)\n", skipped)
	}
	return strings.TrimRight(sb.String(), "\n")
}
