// Foldable page sections: every <details data-section="name"> remembers
// whether it was left open or closed in localStorage, by its name alone, so
// a section folded away on one run's page stays folded on the next run's.
// A link to a section (the page's section navigation, or a #hash in the
// address) opens it, and any section around it, first.

const PREFIX = "tandem.section.";

function load(name) {
  try {
    return window.localStorage.getItem(PREFIX + name);
  } catch {
    return null; // storage disabled: every section starts as the page renders it
  }
}

function save(name, open) {
  try {
    window.localStorage.setItem(PREFIX + name, open ? "open" : "closed");
  } catch {
    // nothing to remember it in
  }
}

function reveal(target) {
  for (let node = target; node; node = node.parentElement?.closest("details")) {
    if (node.tagName === "DETAILS") node.open = true;
  }
}

// onOpen(section): called whenever a section opens (its content gets a width again).
export function rememberSections(root, onOpen) {
  for (const section of root.querySelectorAll("details[data-section]")) {
    const saved = load(section.dataset.section);
    if (saved) section.open = saved === "open";
    section.addEventListener("toggle", () => {
      save(section.dataset.section, section.open);
      if (section.open && onOpen) onOpen(section);
    });
  }
  const fromHash = () => {
    const target = window.location.hash && document.getElementById(decodeURIComponent(window.location.hash.slice(1)));
    if (target) reveal(target);
  };
  // A click on a link to the hash already in the address fires no hashchange: open on the click too.
  root.addEventListener("click", (event) => {
    const link = event.target.closest?.('a[href^="#"]');
    const target = link && document.getElementById(decodeURIComponent(link.hash.slice(1)));
    if (target) reveal(target);
  });
  window.addEventListener("hashchange", fromHash);
  fromHash();
}
