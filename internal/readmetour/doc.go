// Package readmetour checks README.md against the code: its tests run every
// shell command of the README's sh blocks in order on a fresh database
// (TestReadmeTour, only with IDEMQ_README_TOUR=1; .ci/run runs it after the
// quickstart), and compile every Go snippet of its go blocks
// (TestReadmeSnippetsCompile).
//
// A block is left out of the tour by an HTML comment on the line before it,
// visible only in the raw README, with the reason:
//
//	<!-- tour: skip (needs Kafka) -->
package readmetour
