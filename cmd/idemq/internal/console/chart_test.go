package console

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func series1(vs ...int64) [][]int64 {
	out := make([][]int64, len(vs))
	for i, v := range vs {
		out[i] = []int64{v}
	}
	return out
}

var chartStart = time.Date(2026, 12, 2, 13, 0, 0, 0, time.UTC)

// TestChartGeometry: counts to bar heights (proportional to the highest
// bucket, which fills the plot), bars side by side across the plot, a zero
// bucket drawn as a bar of height zero.
func TestChartGeometry(t *testing.T) {
	v := draw(chart{ID: "c", Title: "T", Range: "last hour", Start: chartStart, Step: time.Minute, Series: []string{"a"}, Counts: series1(0, 5, 10, 2)})
	if len(v.Bars) != 4 || v.Max != 10 || v.Total != 17 || v.Empty {
		t.Fatalf("bars %d, max %d, total %d, empty %v", len(v.Bars), v.Max, v.Total, v.Empty)
	}
	want := []float64{0, float64(plotH) / 2, plotH, round1(float64(plotH) / 5)}
	bw := float64(plotW) / 4
	for i, b := range v.Bars {
		if b.H != want[i] {
			t.Errorf("bar %d: height %v, want %v", i, b.H, want[i])
		}
		if b.Y+b.H != v.Base {
			t.Errorf("bar %d does not stand on the axis: y %v + h %v != %v", i, b.Y, b.H, v.Base)
		}
		if x := round1(padL + float64(i)*bw); b.X < x || b.X+b.W > x+bw+0.1 {
			t.Errorf("bar %d: x %v width %v outside its slot [%v, %v]", i, b.X, b.W, x, x+bw)
		}
		if !b.Start.Equal(chartStart.Add(time.Duration(i) * time.Minute)) {
			t.Errorf("bar %d starts %v", i, b.Start)
		}
	}
	if len(v.Bars[0].Segs) != 0 {
		t.Errorf("the zero bar has parts: %+v", v.Bars[0].Segs)
	}
	if len(v.Ticks) == 0 || v.Ticks[0].Label != "13:00" {
		t.Errorf("ticks %+v", v.Ticks)
	}
}

// TestChartEmpty: a series of zeros is no data, with every bar there, of
// height zero.
func TestChartEmpty(t *testing.T) {
	for _, counts := range [][][]int64{series1(0, 0, 0), make([][]int64, 3)} {
		v := draw(chart{ID: "c", Start: chartStart, Step: time.Hour, Counts: counts})
		if !v.Empty || v.Max != 0 || len(v.Bars) != 3 {
			t.Fatalf("empty %v, max %d, bars %d", v.Empty, v.Max, len(v.Bars))
		}
		for _, b := range v.Bars {
			if b.H != 0 || b.Total != 0 {
				t.Errorf("bar %+v", b)
			}
		}
		if !strings.Contains(v.Desc, "no data") {
			t.Errorf("desc %q", v.Desc)
		}
	}
	if v := draw(chart{ID: "c", Start: chartStart, Step: time.Hour}); !v.Empty || len(v.Bars) != 0 {
		t.Errorf("no bucket: %+v", v)
	}
}

// TestChartOutlier: one huge bucket fills the plot; the small ones keep a
// visible minimum height, never zero, and never more than the plot.
func TestChartOutlier(t *testing.T) {
	v := draw(chart{ID: "c", Start: chartStart, Step: time.Minute, Counts: series1(1, 1_000_000_000, 3, 0)})
	if v.Bars[1].H != plotH {
		t.Errorf("the outlier is %v high, want %v", v.Bars[1].H, float64(plotH))
	}
	for _, i := range []int{0, 2} {
		if v.Bars[i].H != minBarHeight {
			t.Errorf("bar %d (%d) is %v high, want the minimum %v", i, v.Bars[i].Total, v.Bars[i].H, minBarHeight)
		}
	}
	if v.Bars[3].H != 0 {
		t.Errorf("the zero bar is %v high", v.Bars[3].H)
	}
	if v.Max != 1_000_000_000 {
		t.Errorf("max %d", v.Max)
	}
}

// TestChartStacked: a stacked bar's parts stack from the axis to the
// bar's top, each as high as its share.
func TestChartStacked(t *testing.T) {
	v := draw(chart{ID: "c", Start: chartStart, Step: time.Minute, Series: []string{"a", "b"}, Counts: [][]int64{{3, 1}, {0, 0}, {0, 2}}})
	b := v.Bars[0]
	if b.H != plotH || len(b.Segs) != 2 {
		t.Fatalf("bar %+v", b)
	}
	if b.Segs[0].Y+b.Segs[0].H != v.Base || b.Segs[1].Y+b.Segs[1].H != b.Segs[0].Y || b.Segs[1].Y != b.Y {
		t.Errorf("parts do not stack: %+v", b.Segs)
	}
	if b.Segs[0].H != round1(plotH*0.75) || b.Segs[0].Class != "s0" || b.Segs[1].Class != "s1" {
		t.Errorf("parts %+v", b.Segs)
	}
	if len(v.Bars[2].Segs) != 1 || v.Bars[2].Segs[0].Class != "s1" {
		t.Errorf("a bar of series b alone: %+v", v.Bars[2].Segs)
	}
	if len(v.Legend) != 2 || v.Legend[0].Total != 3 || v.Legend[1].Total != 3 {
		t.Errorf("legend %+v", v.Legend)
	}
}

// TestStack: the largest series first, those past maxSeries in "other".
func TestStack(t *testing.T) {
	by := map[string][]int64{"a": {1, 0}, "b": {5, 5}, "c": {0, 1}, "d": {2, 2}, "e": {3, 0}, "f": {0, 0}, "g": {1, 1}}
	series, counts, other := stack(by, 2)
	if !other || strings.Join(series, ",") != "b,d,e,g,other" {
		t.Fatalf("series %v, other %v", series, other)
	}
	// other: a 1+0, c 0+1, f 0.
	if counts[0][4] != 1 || counts[1][4] != 1 || counts[0][0] != 5 {
		t.Errorf("counts %v", counts)
	}
	c := chart{Series: series, Other: other}
	if c.seriesClass(4) != "s-other" || c.seriesClass(0) != "s0" {
		t.Errorf("classes %s %s", c.seriesClass(4), c.seriesClass(0))
	}
}

// TestChartTemplate: the SVG has a title and a description, the max
// value, the unit, one bar per bucket with its count, and the no-data
// text when empty; names are escaped.
func TestChartTemplate(t *testing.T) {
	render := func(c chart) string {
		var b bytes.Buffer
		if err := pages["overview"].ExecuteTemplate(&b, "chart", draw(c)); err != nil {
			t.Fatal(err)
		}
		return b.String()
	}
	body := render(chart{ID: "x-hour", Title: "Applied <b>", Range: "last hour", Unit: "messages / minute", What: "applied",
		Start: chartStart, Step: time.Minute, Series: []string{"<i>a</i>", "b"}, Counts: [][]int64{{0, 0}, {4, 3}}, Open: true})
	must(t, body, `<title id="x-hour-title">Applied &lt;b&gt;, last hour</title>`, `aria-labelledby="x-hour-title x-hour-desc"`,
		`data-buckets="2"`, `data-max="7"`, `messages / minute`, `<g class="bar" data-count="0"`, `height="0" data-count="0"`,
		`<g class="bar open" data-count="7"`, "&lt;i&gt;a&lt;/i&gt; 4", "13:01–13:02 UTC: 7 applied so far")
	mustNot(t, body, "<i>a</i>", "<b>", "no data", "style=")
	must(t, render(chart{ID: "y", Range: "last day", Start: chartStart, Step: time.Hour, Counts: series1(0, 0)}), "no data in the last day", `data-empty="true"`)
}
