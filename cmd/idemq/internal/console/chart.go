package console

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// chart is one bar chart over time buckets, as every chart of the console
// draws it: a bar per bucket, stacked by series, drawn as inline SVG by the
// template "chart" (templates/chart.html) from the geometry draw computes.
type chart struct {
	// ID names the chart: its element id and data-chart.
	ID string
	// Title says what is counted ("Applied messages"); Range the window
	// ("last hour"); Unit the y axis ("messages / minute"); What the
	// counted things in a bar's tooltip ("applied").
	Title, Range, Unit, What string
	// Start is the first bucket's start; Step a bucket's width.
	Start time.Time
	Step  time.Duration
	// Series names the stacked layers, bottom first; Other says the last
	// one gathers the rest ("other"), drawn grey.
	Series []string
	Other  bool
	// Counts holds a bucket's count per series: Counts[bucket][series].
	Counts [][]int64
	// Open says the last bucket has not ended: its count is so far.
	Open bool
	// Notes are said under the chart: a truncated sample, ages, what the
	// window leaves out.
	Notes []string
	// Err, or Unavailable, is said in place of the bars.
	Err, Unavailable string
}

// The geometry of every chart, in SVG user units: the plot is the box the
// bars stand in, padded for the axis labels.
const (
	chartW, chartH         = 560, 170
	padL, padR, padT, padB = 46, 10, 24, 30
	plotW, plotH           = chartW - padL - padR, chartH - padT - padB
	maxSeries              = 5 // named series of a stacked chart; the rest is "other"
	labelMax               = 60
	minBarHeight           = 1.0
	tickCount              = 4
	bucketTimeFormat       = "15:04"
	rangeTimeFormat        = "2006-01-02 15:04"
	otherSeries            = "other"
	noDataPrefix           = "no data"
)

// chartView is a chart ready for its template.
type chartView struct {
	chart
	W, H                   int
	PlotX, PlotY, PlotW    float64
	PlotH, Base, PlotR     float64
	Bars                   []barView
	Max, Total             int64
	Empty                  bool
	Ticks                  []tick
	Desc, From, To         string
	Legend                 []legendItem
	NoDataX, NoDataY       float64
	MaxLabelY, ZeroLabelY  float64
	UnitX, UnitY, AxisNote float64
}

// barView is one bucket's bar; Segs are its stacked parts, bottom first.
// A bucket of zero has a bar of height zero, and no part.
type barView struct {
	X, W, Y, H float64
	Start      time.Time
	Total      int64
	Label      string
	Open       bool
	Segs       []segView
}

type segView struct {
	X, W, Y, H float64
	Class      string
	Series     string
	Count      int64
}

type tick struct {
	X     float64
	Label string
}

type legendItem struct {
	Class, Name string
	Total       int64
}

// round1 keeps one decimal: SVG coordinates need no more.
func round1(x float64) float64 { return math.Round(x*10) / 10 }

// barHeight maps a count to a bar height in a plot plotH high whose top is
// max: proportional, except that a count above zero is at least
// minBarHeight high (so that one huge outlier does not hide the others,
// whose exact counts the bar's tooltip and data-count say), and zero is
// zero high.
func barHeight(v, max int64, plotH float64) float64 {
	if v <= 0 || max <= 0 {
		return 0
	}
	h := float64(v) / float64(max) * plotH
	return round1(math.Min(math.Max(h, minBarHeight), plotH))
}

// seriesClass is the CSS class of series i of c.
func (c *chart) seriesClass(i int) string {
	if c.Other && i == len(c.Series)-1 {
		return "s-other"
	}
	return fmt.Sprintf("s%d", i%maxSeries)
}

// draw computes c's geometry.
func draw(c chart) chartView {
	v := chartView{chart: c, W: chartW, H: chartH, PlotX: padL, PlotY: padT, PlotW: plotW, PlotH: plotH, Base: padT + plotH, PlotR: padL + plotW}
	n := len(c.Counts)
	end := c.Start.Add(time.Duration(n) * c.Step)
	v.From, v.To = c.Start.UTC().Format(rangeTimeFormat), end.UTC().Format(rangeTimeFormat)
	v.NoDataX, v.NoDataY = padL+plotW/2, padT+plotH/2
	v.MaxLabelY, v.ZeroLabelY = padT+4, padT+plotH+4
	v.UnitX, v.UnitY, v.AxisNote = padL, 14, chartH-4
	totals := make([]int64, len(c.Series))
	for _, counts := range c.Counts {
		var t int64
		for i, x := range counts {
			t += x
			if i < len(totals) {
				totals[i] += x
			}
		}
		v.Max = max(v.Max, t)
		v.Total += t
	}
	v.Empty = v.Total == 0
	if n > 0 {
		bw := float64(plotW) / float64(n)
		gap := math.Min(2, bw*0.2)
		for i, counts := range c.Counts {
			start := c.Start.Add(time.Duration(i) * c.Step)
			b := barView{X: round1(padL + float64(i)*bw + gap/2), W: round1(bw - gap), Start: start, Open: c.Open && i == n-1}
			for _, x := range counts {
				b.Total += x
			}
			b.H = barHeight(b.Total, v.Max, plotH)
			b.Y = round1(v.Base - b.H)
			// The parts split the bar's height in proportion; the
			// bar's top is the last part's top, whatever the rounding.
			var cum int64
			top := v.Base
			for si, x := range counts {
				if x <= 0 {
					continue
				}
				cum += x
				y := round1(v.Base - b.H*float64(cum)/float64(b.Total))
				name := ""
				if si < len(c.Series) {
					name = c.Series[si]
				}
				b.Segs = append(b.Segs, segView{X: b.X, W: b.W, Y: y, H: round1(top - y), Class: c.seriesClass(si), Series: name, Count: x})
				top = y
			}
			b.Label = c.barLabel(b, counts)
			v.Bars = append(v.Bars, b)
		}
		every := max(n/tickCount, 1)
		for i := 0; i < n; i += every {
			v.Ticks = append(v.Ticks, tick{X: round1(padL + float64(i)*bw), Label: c.Start.Add(time.Duration(i) * c.Step).UTC().Format(bucketTimeFormat)})
		}
	}
	if len(c.Series) > 1 {
		for i, name := range c.Series {
			v.Legend = append(v.Legend, legendItem{Class: c.seriesClass(i), Name: name, Total: totals[i]})
		}
	}
	v.Desc = c.describe(v)
	return v
}

// barLabel is a bar's tooltip: its bucket, its count and, stacked, the
// count of each series.
func (c *chart) barLabel(b barView, counts []int64) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%s–%s UTC: %d %s", b.Start.UTC().Format(bucketTimeFormat), b.Start.Add(c.Step).UTC().Format(bucketTimeFormat), b.Total, c.What)
	if b.Open {
		sb.WriteString(" so far")
	}
	if len(c.Series) > 1 && b.Total > 0 {
		var parts []string
		for i, x := range counts {
			if x > 0 && i < len(c.Series) {
				parts = append(parts, fmt.Sprintf("%s %d", c.Series[i], x))
			}
		}
		sb.WriteString(" (" + strings.Join(parts, ", ") + ")")
	}
	return sb.String()
}

// describe is the chart's SVG description, for screen readers.
func (c *chart) describe(v chartView) string {
	s := fmt.Sprintf("%s, %s: %d buckets of %s from %s to %s UTC. ", c.Title, c.Range, len(c.Counts), stepName(c.Step), v.From, v.To)
	if v.Empty {
		return s + noDataPrefix + "."
	}
	return s + fmt.Sprintf("Total %d %s; the highest bucket holds %d.", v.Total, c.What, v.Max)
}

func stepName(d time.Duration) string {
	switch d {
	case time.Minute:
		return "one minute"
	case time.Hour:
		return "one hour"
	}
	return d.String()
}

// stack orders the series of per-name counts by their totals, largest
// first, and folds those past maxSeries into one "other" series. byName
// holds each name's counts per bucket, n buckets.
func stack(byName map[string][]int64, n int) (series []string, counts [][]int64, other bool) {
	type tot struct {
		name string
		sum  int64
	}
	var all []tot
	for name, cs := range byName {
		var s int64
		for _, x := range cs {
			s += x
		}
		all = append(all, tot{name, s})
	}
	// Largest first; ties by name, so that the order is stable.
	for i := 1; i < len(all); i++ {
		for j := i; j > 0 && (all[j].sum > all[j-1].sum || all[j].sum == all[j-1].sum && all[j].name < all[j-1].name); j-- {
			all[j], all[j-1] = all[j-1], all[j]
		}
	}
	named := all
	if len(all) > maxSeries {
		named, other = all[:maxSeries-1], true
	}
	for _, t := range named {
		series = append(series, clip(t.name, labelMax))
	}
	if other {
		series = append(series, otherSeries)
	}
	counts = make([][]int64, n)
	for b := range counts {
		counts[b] = make([]int64, len(series))
		for i, t := range all {
			si := min(i, len(series)-1)
			if cs := byName[t.name]; b < len(cs) {
				counts[b][si] += cs[b]
			}
		}
	}
	return series, counts, other
}

// clip shortens s to n runes, with an ellipsis.
func clip(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}
